"""Training-step speed of a preset on this machine: step time, tokens/s, FLOP/s vs matmul peak.

The peak is measured in the same run with one large `jnp.dot`, so the fraction
reads "how close the step gets to this CPU's own matmul throughput".
Run: `python benchmarks/train_step.py [--preset nano] [--batch-size 32] [--steps 10]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.profile.flops import flops_per_token, measure_matmul_flops
from eqgpt.train import SingleDevice, TrainState, make_lr_schedule, make_optimizer, make_train_step


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="nano")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    cfg = eqgpt.preset(args.preset)
    placement = SingleDevice()
    opt = make_optimizer(make_lr_schedule(1e-3, total_steps=1000, warmup_steps=10))
    model = placement.init_model(lambda k: GPT(cfg, key=k), jax.random.key(0))
    state = TrainState(model, placement.init_opt_state(opt, model), rng=jax.random.key(1))
    step = make_train_step(opt)
    rng = np.random.default_rng(0)
    batches = [placement.batch(Batch.from_windows(
        rng.integers(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1)).astype(np.int32)))
        for _ in range(args.steps + 1)]

    t0 = time.perf_counter()
    state, m = step(state, batches[0])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        state, m = step(state, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    peak = measure_matmul_flops()

    step_s = float(np.median(times))
    tokens = args.batch_size * cfg.seq_len
    fpt = flops_per_token(cfg)
    achieved = tokens * fpt / step_s
    rows = [
        ("preset", f"{args.preset} ({cfg.num_layers}L x {cfg.embed_dim}, seq {cfg.seq_len})"),
        ("batch (tokens)", f"{args.batch_size} x {cfg.seq_len} = {tokens}"),
        ("device", str(jax.devices()[0])),
        ("compile + first step", f"{compile_s:.2f} s"),
        ("step time (median)", f"{step_s * 1e3:.0f} ms  (min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f})"),
        ("tokens/s", f"{tokens / step_s:,.0f}"),
        ("FLOPs/token", f"{fpt / 1e6:.2f} M"),
        ("achieved FLOP/s", f"{achieved / 1e9:.2f} G"),
        ("matmul FLOP/s (2048^2 jnp.dot)", f"{peak / 1e9:.2f} G"),
        ("fraction of matmul peak", f"{achieved / peak:.1%}"),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


if __name__ == "__main__":
    main()
