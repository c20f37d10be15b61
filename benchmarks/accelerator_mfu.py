"""MFU, step time, memory and where the time goes of a one-accelerator training step (TPU or GPU).

Builds the preset, runs `make_train_step` (AdamW, bf16 compute with fp32 parameters
unless told otherwise) on random tokens for `--warmup` + `--steps` steps and prints
one table: median step time, tokens/s, model FLOP/s (`eqgpt.profile.flops`: 6 per
weight per token plus causal attention), MFU against the device's bf16 dense peak
(`eqgpt.profile.flops.peak_flops`), and the device's peak memory in use.

`--breakdown` also traces three steps with `jax.profiler` and prints one step's device
time by category (`eqgpt.profile.trace.category_table`): the attention kernel, the
other matmuls, the LM head and loss, the optimizer update, and everything else.

    python benchmarks/accelerator_mfu.py --preset gpt2-small --batch 16 --breakdown
    python benchmarks/accelerator_mfu.py --preset llama-1b --batch 4 --remat minimal --mu-dtype bf16

Without an accelerator it says so and exits 0, unless `--cpu` asks for a (small) CPU run,
as the test of this script does: `--cpu --preset nano --kernel reference --precision fp32`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import equinox as eqx
import jax
import numpy as np

import eqgpt
from eqgpt.config import scans_by_default
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.profile.flops import flops_per_token, peak_flops
from eqgpt.profile.memory import memory
from eqgpt.train import Policy, Strategy, TrainState, make_optimizer, make_train_step


def measure(cfg: eqgpt.GPTConfig, *, batch: int, precision: str = "bf16", steps: int = 10, warmup: int = 3,
            mu_dtype: str | None = None, master_weights: bool = False, breakdown: bool = False,
            loss_chunk: int = 128, save_to: str | None = None, int8_backward: str = "qat") -> dict:
    """Train `steps` steps of `cfg` on random tokens; **returns** the figures `main` prints."""
    policy = Policy.named(precision, master_weights=master_weights, int8_backward=int8_backward)
    strategy = Strategy()
    optimizer = policy.optimizer(make_optimizer(3e-4, weight_decay=0.1, clip_norm=1.0, mu_dtype=mu_dtype))
    model = strategy.init_model(lambda k: policy.cast_to_param(GPT(cfg, key=k)), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1),
                       loss_scale=policy.loss_scale_state())
    step = make_train_step(optimizer, grad_fn=strategy.grad_fn(policy, chunk_size=loss_chunk)) \
        if loss_chunk != 128 and not policy.loss_scaling \
        else make_train_step(optimizer, strategy=strategy, policy=policy)
    rng = np.random.default_rng(0)
    batches = [strategy.batch(Batch.from_windows(
        rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1)).astype(np.int32))) for _ in range(2)]
    compiled = step.lower(state, batches[0]).compile()
    report = memory(compiled)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batches[i % 2])
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    table = None
    if breakdown:
        from eqgpt.profile.trace import category_table, step_annotation, trace

        with tempfile.TemporaryDirectory() as logs:
            with trace(logs, perfetto=False):
                for i in range(3):
                    with step_annotation(i):
                        state, metrics = step(state, batches[i % 2])
                        jax.block_until_ready(metrics)
            table = category_table(logs, hlo_text=compiled)
            if save_to:
                import shutil

                from eqgpt.profile.trace import trace_files
                shutil.copy(trace_files(logs)["xplane"], f"{save_to}.xplane.pb")
                open(f"{save_to}.hlo.txt", "w").write(compiled.compiled.as_text())
    seconds = float(np.median(times))
    tokens = batch * cfg.seq_len
    device = jax.devices()[0]
    peak, source = peak_flops(device)
    achieved = flops_per_token(cfg) * tokens / seconds
    stats = device.memory_stats() or {}
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "flops": achieved, "peak": peak,
            "peak_source": source, "mfu": achieved / peak, "peak_bytes": stats.get("peak_bytes_in_use"),
            "compiled_bytes": report.peak_bytes,
            "loss": float(metrics["loss"]),
            "params": sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))),
            "breakdown": table}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--kernel", default="auto",
                   help="attention kernel (default auto: flash or splash on TPU, cudnn on GPU)")
    p.add_argument("--remat", default=None, help="remat policy (default: the preset's)")
    p.add_argument("--scan-layers", action="store_true", help="scan the layers (default: as the recipe, "
                   "unrolled up to 12 layers on an accelerator, eqgpt.config.scans_by_default)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16", "int8"),
                   help="int8: bf16 with the projection and MLP matmuls through int8 (MFU still counts bf16 FLOPs)")
    p.add_argument("--int8-backward", default="qat", choices=("qat", "qt"), help="with --precision int8")
    p.add_argument("--mu-dtype", default=None, help="AdamW first-moment dtype, e.g. bf16 (default: the parameters')")
    p.add_argument("--master-weights", action="store_true", help="bf16 parameters, fp32 master weights")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--breakdown", action="store_true", help="trace 3 steps and print the time by category")
    p.add_argument("--cpu", action="store_true", help="run even without an accelerator (a check of this script)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform not in ("gpu", "tpu") and not args.cpu:
        print(f"no GPU or TPU here (JAX sees {device.platform}); run this on an accelerator, or pass --cpu "
              "with a small --preset to check the script.")
        return 0
    overrides = {"attention_kernel": args.kernel} | ({"seq_len": args.seq} if args.seq else {}) \
        | ({"remat": args.remat} if args.remat else {}) \
        | {"scan_layers": args.scan_layers or scans_by_default(eqgpt.preset(args.preset).num_layers, device.platform)}
    cfg = eqgpt.preset(args.preset, **overrides)
    r = measure(cfg, batch=args.batch, precision=args.precision, steps=args.steps, warmup=args.warmup,
                mu_dtype=args.mu_dtype, master_weights=args.master_weights, breakdown=args.breakdown,
                int8_backward=args.int8_backward)
    print(f"{args.preset} ({r['params'] / 1e6:.0f}M params), batch {args.batch} x {cfg.seq_len}, {args.precision}"
          f"{' ' + args.int8_backward if args.precision == 'int8' else ''} "
          f"compute, {args.kernel} attention, remat {cfg.remat}, "
          f"layers {'scanned' if cfg.scan_layers else 'unrolled'}; {device.device_kind}; jax {jax.__version__}; "
          f"median of {args.steps} steps")
    gib = lambda b: "n/a (this backend keeps no statistics)" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    rows = [("step time", f"{r['seconds'] * 1e3:.1f} ms"), ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
            ("model FLOP/s", f"{r['flops'] / 1e12:.1f} TFLOP/s"),
            ("peak", f"{r['peak'] / 1e12:.1f} TFLOP/s ({r['peak_source']})"), ("MFU", f"{r['mfu']:.1%}"),
            ("compiled step peak", gib(r["compiled_bytes"])), ("peak memory in use", gib(r["peak_bytes"])),
            ("final loss", f"{r['loss']:.3f}")]
    for name, value in rows:
        print(f"  {name:<22} {value}")
    if r["breakdown"]:
        print(r["breakdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
