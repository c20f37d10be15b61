"""MFU, step time and memory of a single-accelerator training step: GPT-2 small, bf16 compute, cuDNN attention on GPU.

Builds the preset, runs `make_train_step` (AdamW, bf16 compute with fp32 parameters)
on random tokens for `--warmup` + `--steps` steps and prints one table: median
step time, tokens/s, model FLOP/s (`eqgpt.profile.flops`: 6 per weight per token
plus causal attention), MFU against the device's bf16 dense peak (the GPU table of
`eqgpt.profile.flops.peak_flops`; a TPU's from its table too), and the device's peak
memory in use.

Run on a GPU machine: `python benchmarks/gpu_mfu.py [--batch 16] [--kernel cudnn]`; on a
TPU the same (the default kernel there is `blockwise`: cuDNN is GPU-only).
Without an accelerator it says so and exits 0, unless `--cpu` asks for a (small) CPU run, as
the test of this script does: `--cpu --preset nano --kernel reference --precision fp32`.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.profile.flops import flops_per_token, peak_flops
from eqgpt.train import Policy, Strategy, TrainState, make_optimizer, make_train_step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--kernel", default=None, help="attention kernel: cudnn (the GPU default), blockwise (the TPU "
                   "default), reference")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="run even without a GPU (a check of this script)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform not in ("gpu", "tpu") and not args.cpu:
        print(f"no GPU or TPU here (JAX sees {device.platform}); run this on a GPU machine, or pass --cpu "
              "with a small --preset to check the script.")
        return 0
    args.kernel = args.kernel or ("cudnn" if device.platform == "gpu" else "blockwise")

    overrides = {"attention_kernel": args.kernel} | ({"seq_len": args.seq} if args.seq else {})
    cfg = eqgpt.preset(args.preset, **overrides)
    policy = Policy.named(args.precision)
    strategy = Strategy()
    optimizer = policy.optimizer(make_optimizer(3e-4, weight_decay=0.1, clip_norm=1.0))
    model = strategy.init_model(lambda k: policy.cast_to_param(GPT(cfg, key=k)), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1),
                       loss_scale=policy.loss_scale_state())
    step = make_train_step(optimizer, strategy=strategy, policy=policy)
    rng = np.random.default_rng(0)
    batches = [strategy.batch(Batch.from_windows(
        rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1)).astype(np.int32))) for _ in range(2)]

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batches[i % 2])
        jax.block_until_ready(metrics)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    tokens = args.batch * cfg.seq_len
    achieved = flops_per_token(cfg) * tokens / seconds
    peak, source = peak_flops(device)
    stats = device.memory_stats() or {}
    peak_mem = stats.get("peak_bytes_in_use")

    print(f"{args.preset} ({sum(x.size for x in jax.tree.leaves(model)) / 1e6:.0f}M params), batch {args.batch} x "
          f"{cfg.seq_len}, {args.precision} compute, {args.kernel} attention; {device.device_kind}; "
          f"jax {jax.__version__}; median of {args.steps} steps")
    rows = [("step time", f"{seconds * 1e3:.1f} ms"), ("tokens/s", f"{tokens / seconds:,.0f}"),
            ("model FLOP/s", f"{achieved / 1e12:.1f} TFLOP/s"), ("peak", f"{peak / 1e12:.1f} TFLOP/s ({source})"),
            ("MFU", f"{achieved / peak:.1%}"),
            ("peak memory in use", "n/a (this backend keeps no statistics)" if peak_mem is None
             else f"{peak_mem / 2**30:.2f} GiB"),
            ("final loss", f"{float(metrics['loss']):.3f}")]
    for name, value in rows:
        print(f"  {name:<20} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
