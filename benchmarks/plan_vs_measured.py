"""The planner's predicted step against the step measured on this machine's first device (a TPU v5e).

For each case the trainer's own step (`make_train_step`, lowered and compiled as `eqgpt-train`
does, with the trainer's initial state) is compiled once. The planner's model
(`eqgpt.plan.model.predict`, the calibration table in `src/eqgpt/plan/calibration/`, or
`--calibration`) predicts that compiled program's step time; then the same program runs
`--warmup` steps and `--steps` timed steps on random tokens, waited for at the end: the measured
step time. The calibration comes from microbenchmarks (`benchmarks/plan_calibration.py`),
never from these steps. Prints one row per case (predicted ms by part, measured ms, error).

The cases are the flags of the one-chip runs in `docs/profiling.md`. On a TPU v5e, one case a
call keeps each under a few minutes (the compile dominates):

    python benchmarks/plan_vs_measured.py --cases gpt2-small --out /tmp/pvm_gpt2-small.txt

`--quick` runs tiny models of the same kinds (a CPU check of the script; the prediction is still
for a v5e, so its error means nothing there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# name, eqgpt-train flags (those of the one-chip runs in docs/profiling.md; gpt2-medium, which has none: 4 rows,
# whose memory estimate, 18.5 GiB, is below gpt2-small's at 16 rows, 19.5 GiB, which fits), tiny flags for --quick
CASES = (
    ("gpt2-small", ["--model.preset", "gpt2-small", "--precision", "bf16", "--batch-size", "16"],
     ["--model.preset", "nano", "--batch-size", "4"]),
    ("gpt2-medium", ["--model.preset", "gpt2-medium", "--precision", "bf16", "--batch-size", "4"],
     ["--model.preset", "nano", "--batch-size", "2", "--model.scan-layers"]),
    ("llama-1b", ["--model.preset", "llama-1b", "--precision", "bf16", "--master-weights", "--optim.mu-dtype", "bf16",
                  "--model.remat", "full", "--batch-size", "5"],
     ["--model.preset", "llama-nano", "--precision", "bf16", "--master-weights", "--optim.mu-dtype", "bf16",
      "--model.remat", "full", "--batch-size", "2"]),
    ("gpt2-small-moe", ["--model.preset", "gpt2-small-moe", "--precision", "bf16", "--batch-size", "16"],
     ["--model.preset", "moe-nano", "--batch-size", "4"]),
)


def measure(flags: list[str], *, warmup: int, steps: int, calibration: str | None) -> dict:
    """Compile the trainer's step for `flags` on the first device, predict it, run it; **returns** the row."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from eqgpt.cli import parse_cli
    from eqgpt.cli.train import TrainConfig, optimizer_of, policy_of, strategy_of
    from eqgpt.data.batch import Batch
    from eqgpt.nn import GPT
    from eqgpt.nn.kernels.grouped import auto_grouped_kernel
    from eqgpt.plan.calibration import load
    from eqgpt.plan.model import predict
    from eqgpt.plan.slices import parse_slice
    from eqgpt.train import make_train_step
    from eqgpt.train.fit import kernel_name
    from eqgpt.train.state import initial_state

    cfg = parse_cli(TrainConfig, args=flags)
    model_cfg, block_factory = cfg.model.build(), cfg.model.block_factory()
    strategy, policy = strategy_of(cfg), policy_of(cfg)
    make_model = lambda k: policy.cast_to_param(GPT(model_cfg, key=k, block_factory=block_factory))  # noqa: E731
    model_like = jax.eval_shape(make_model, jax.random.key(0))
    strategy.check(model_like, batch_size=cfg.batch_size, seq_len=model_cfg.seq_len, accum_steps=cfg.accum_steps)
    optimizer, _ = optimizer_of(cfg, policy)
    state = initial_state(optimizer, strategy, policy, make_model, cfg.seed)
    step_fn = make_train_step(optimizer, strategy=strategy, policy=policy, accum_steps=cfg.accum_steps,
                              z_loss=cfg.z_loss, model_like=model_like)
    rng = np.random.default_rng(0)
    batches = [strategy.batch(Batch.from_windows(
        rng.integers(0, model_cfg.vocab_size, (cfg.batch_size, model_cfg.seq_len + 1)).astype(np.int32)))
        for _ in range(warmup + steps)]
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batches[0]).compile()  # what the trainer runs (`compiled_step`)
    compile_s = time.perf_counter() - t0

    slice_ = parse_slice("v5e-1")  # the chip's figures; one device, no collectives
    mesh = strategy.mesh or Mesh(np.array(jax.devices()[:1]), ("data",))
    kernel = kernel_name(model_cfg, policy)
    prediction = predict(compiled, mesh=mesh, slice_=slice_, model_cfg=model_cfg, batch_size=cfg.batch_size,
                         accum_steps=cfg.accum_steps, calibration=load(slice_.chip.name, path=calibration),
                         pallas_attention=kernel in ("flash", "splash"),
                         pallas_grouped=model_cfg.moe is not None and model_cfg.moe.dropless
                         and auto_grouped_kernel() == "megablox")
    for b in batches[:warmup]:
        state, metrics = compiled(state, b)
    jax.block_until_ready((state, metrics))
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        state, metrics = compiled(state, b)
    jax.block_until_ready((state, metrics))
    measured = (time.perf_counter() - t0) / steps
    p = prediction
    return {"kernel": kernel, "batch_size": cfg.batch_size, "seq_len": model_cfg.seq_len, "compile_s": compile_s,
            "predicted": p.step, "matmul": p.matmul, "attention": p.attention, "memory_bound": p.memory_bound,
            "collectives": p.exposed, "matmul_efficiency": p.matmul_efficiency,
            "attention_efficiency": p.attention_efficiency, "measured": measured,
            "error": p.step / measured - 1, "calibration": "provisional" if p.provisional else "measured",
            "device": str(jax.devices()[0].device_kind)}


def table(rows: list[dict]) -> str:
    head = (f"{'model':<22} {'kernel':<9} {'batch':>5} {'matmul':>8} {'attn':>7} {'memory':>7} {'comm':>6} "
            f"{'predicted':>10} {'measured':>9} {'error':>7}  (ms per step; compile s)")
    lines = [head]
    for r in rows:
        lines.append(f"{r['model']:<22} {r['kernel']:<9} {r['batch_size']:>5} {1e3 * r['matmul']:>8.1f} "
                     f"{1e3 * r['attention']:>7.1f} {1e3 * r['memory_bound']:>7.1f} {1e3 * r['collectives']:>6.1f} "
                     f"{1e3 * r['predicted']:>10.1f} {1e3 * r['measured']:>9.1f} {100 * r['error']:>+6.1f}%  "
                     f"({r['compile_s']:.0f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case names")
    parser.add_argument("--quick", action="store_true", help="tiny models of the same kinds (a CPU check)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--calibration", default=None, help="a calibration JSON (default: the package's v5e.json)")
    parser.add_argument("--out", default=None, help="also write the table and the rows (JSON) to this file")
    args = parser.parse_args(argv)
    names = args.cases.split(",")
    unknown = set(names) - {c[0] for c in CASES}
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; choose from {[c[0] for c in CASES]}")
    rows, failed = [], []
    print(table([]), flush=True)
    for name, flags, quick in CASES:
        if name in names:
            try:
                row = measure(quick if args.quick else flags, warmup=args.warmup, steps=args.steps,
                              calibration=args.calibration)
            except Exception as e:  # noqa: BLE001 (one case failing, e.g. out of memory, leaves the others)
                failed.append(f"{name}: failed: {str(e).strip().splitlines()[0][:300]}")
                print(failed[-1], flush=True)
                continue
            rows.append({"model": name + (" (quick)" if args.quick else ""),
                         "flags": " ".join(quick if args.quick else flags), **row})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not rows:
        if args.out:
            Path(args.out).write_text("\n".join(failed) + "\n")
        return 1
    text = (f"planner vs measured step on {rows[0]['device']} ({rows[0]['calibration']} calibration); "
            f"{args.warmup} warm-up steps, then the mean of {args.steps}\n" + table(rows) + "\nflags:\n"
            + "\n".join(f"  {r['model']}: {r['flags']}" for r in rows) + "".join(f"\n{f}" for f in failed))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n" + json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
