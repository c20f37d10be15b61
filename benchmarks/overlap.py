"""Communication of a train step without and with its optimizations, for dp, fsdp, fsdp+tp and manual TP/SP.

For each strategy, compiles the library's train step twice, off and on, where "on" is
`overlap=True` on the automatic path, gradient buckets (`bucket_mb`) on the manual path,
and collective matmul too under manual SP (`CASES`), and prints: collectives per step
(ops and executions) and their bytes per device (`eqgpt.profile.collectives`); the share
of those bytes with compute beside them to hide behind (`eqgpt.profile.schedule`:
structurally, and with enough of it at a nominal link of `--bandwidth` bytes/s and
`--peak` FLOP/s); and the measured step time (median of `--steps`), and XLA's temporary
memory per device. On CPU, XLA runs every collective synchronously and ignores the GPU
flags, so times show the cost of the changed program, not hidden communication.
Run: `python benchmarks/overlap.py` (8 simulated CPU devices unless a GPU is present).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

OVERLAP = {"overlap": True}
BUCKETS = {"bucket_mb": 1.0}
CASES = {  # name: (mesh, rules, manual, the Strategy options "on" sets)
    "dp": ("data=8", "dp", False, OVERLAP),
    "fsdp": ("fsdp=8", "fsdp", False, OVERLAP),
    "fsdp+tp": ("fsdp=4,tensor=2", "fsdp+tp", False, OVERLAP),
    "manual dp+tp": ("data=2,tensor=4", "dp+tp", True, BUCKETS),
    "manual dp+sp": ("data=2,tensor=4", "dp+sp", True, {**BUCKETS, "collective_matmul": True}),
}


def compile_case(name: str, on: bool, args) -> tuple:
    """The train step of case `name`, off or `on`, compiled; **returns** (compiled, strategy, state, batch)."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    import eqgpt
    from eqgpt import nn
    from eqgpt.data import Batch
    from eqgpt.parallel import ParallelFlags
    from eqgpt.train import TrainState, make_train_step

    mesh, rules, manual, options = CASES[name]
    strategy = ParallelFlags.parse(mesh, rules, manual=manual, **(options if on else {}))
    config = eqgpt.GPTConfig(vocab_size=256, seq_len=args.seq, num_layers=args.layers, num_heads=4,
                             embed_dim=args.embed, scan_layers=args.scan)
    model = strategy.init_model(lambda k: nn.GPT(config, key=k), jax.random.key(0))
    optimizer = optax.adamw(1e-3)
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(0))
    step = make_train_step(optimizer, strategy=strategy, model_like=eqx.filter_eval_shape(lambda: model))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, 256))
    batch = strategy.batch(Batch.from_windows(tokens))
    return step.lower(state, batch).compile(), strategy, state, batch


def measure(name: str, on: bool, args) -> dict:
    """One compiled step of case `name`: collective ops, executions and bytes, overlappable
    shares, median step seconds."""
    import jax

    from eqgpt.profile import collectives, memory, schedule, schedule_summary

    compiled, strategy, state, batch = compile_case(name, on, args)
    rows = collectives(compiled, strategy.mesh)
    report = schedule(compiled, strategy.mesh)
    structural = schedule_summary(report)
    nominal = schedule_summary(report, bandwidth=args.bandwidth, peak=args.peak)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return {"ops": len(rows), "runs": sum(r.executions for r in rows), "bytes": structural.total,
            "share": structural.overlappable_share, "nominal": nominal.overlappable_share,
            "async": structural.async_bytes, "temp": memory(compiled).temp_bytes,
            "seconds": statistics.median(times[1:])}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--scan", action="store_true", help="scan the layers (default: unrolled, as the recipe)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    parser.add_argument("--bandwidth", type=float, default=450e9, help="nominal link bytes/s (H100 NVLink)")
    parser.add_argument("--peak", type=float, default=989e12, help="nominal FLOP/s (H100 bf16 dense)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eqgpt.parallel.overlap import set_overlap_flags

    set_overlap_flags()  # before the backend starts (GPU only; ignored on CPU)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # CPU only, before the backend starts
    if jax.default_backend() == "cpu" and jax.device_count() < 8:
        raise SystemExit("needs 8 devices: run with JAX_NUM_CPU_DEVICES=8 (or on 8 GPUs)")
    print(f"{jax.default_backend()}, {jax.device_count()} devices; GPT {args.layers} layers x {args.embed}, "
          f"seq {args.seq}, batch {args.batch}, {'scanned' if args.scan else 'unrolled'}; per device per step")
    print("on: " + "; ".join(f"{name}: {', '.join(f'{k}={v}' for k, v in CASES[name][3].items())}"
                             for name in args.cases))
    head = ("strategy", "optimized", "ops", "runs", "KiB", "overlappable", "at nominal", "async KiB", "temp KiB",
            "step ms")
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for name in args.cases:
        for on in (False, True):
            m = measure(name, on, args)
            print(f"| {name} | {'on' if on else 'off'} | {m['ops']} | {m['runs']} | {m['bytes'] / 1024:.1f} | "
                  f"{m['share']:.0%} | {m['nominal']:.0%} | {m['async'] / 1024:.1f} | "
                  f"{m['temp'] / 1024:.0f} | {m['seconds'] * 1e3:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    raise SystemExit(main())
