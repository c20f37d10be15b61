"""Loader throughput against the training step's consumption, and the time the step waits for data.

For the default recipe (preset `nano`, batch 32, the stdlib corpus) it measures:

1. how many batches per second each data mode builds in the calling thread
   (`threads=0`: the pure cost of a batch);
2. the training step's rate on this machine (compiled, steady state);
3. a training loop fed by the Grain loader with background threads: the total and
   per-step time `local_batch` blocked (the wait), which prefetch should make ~0.

Run: `python benchmarks/loader_speed.py [--steps 30] [--mode packed]`.
"""

from __future__ import annotations

import argparse
import time

import jax

from eqgpt.config import PRESETS
from eqgpt.data import load_corpus
from eqgpt.data.grain_source import LoaderConfig, make_loader
from eqgpt.nn import GPT
from eqgpt.train import Strategy, TrainState, make_lr_schedule, make_optimizer, make_train_step


def loader_rate(corpus, mode: str, batch: int, seq: int, n: int = 200) -> float:
    """Batches per second built in the calling thread (no prefetch)."""
    loader = make_loader(corpus.train, batch_size=batch, seq_len=seq, docs=corpus.train_docs,
                         config=LoaderConfig(mode=mode, threads=0))
    loader.local_batch(0)
    t = time.perf_counter()
    for s in range(1, n + 1):
        loader.local_batch(s)
    return n / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--preset", default="nano")
    p.add_argument("--mode", default="windows", choices=["windows", "packed"])
    args = p.parse_args()
    cfg = PRESETS[args.preset]
    corpus = load_corpus("stdlib", min_tokens=cfg.seq_len + 1)
    b, t = args.batch_size, cfg.seq_len

    strategy = Strategy()
    optimizer = make_optimizer(make_lr_schedule(1e-3, total_steps=1000, warmup_steps=10))
    model = strategy.init_model(lambda k: GPT(cfg, key=k), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    step_fn = make_train_step(optimizer, strategy=strategy)
    loader = make_loader(corpus.train, batch_size=b, seq_len=t, docs=corpus.train_docs,
                         config=LoaderConfig(mode=args.mode, threads=2, prefetch=4))
    state, m = step_fn(state, strategy.batch(loader.local_batch(0)))  # compile
    jax.block_until_ready(m)
    loader.wait_s, waits = 0.0, []
    t0 = time.perf_counter()
    for s in range(1, args.steps + 1):
        before = loader.wait_s
        batch = strategy.batch(loader.local_batch(s))
        waits.append(loader.wait_s - before)
        state, m = step_fn(state, batch)
    jax.block_until_ready(m)
    step_rate = args.steps / (time.perf_counter() - t0)
    loader.close()

    rates = {mode: loader_rate(corpus, mode, b, t) for mode in ("windows", "packed")}
    print(f"default recipe: preset {args.preset}, batch {b} x seq {t}, {jax.devices()[0].platform}, "
          f"training loop in {args.mode} mode")
    print(f"{'what':<40}{'batches/s':>12}{'x step':>10}")
    print(f"{'training step (steady state)':<40}{step_rate:>12.1f}{1.0:>10.1f}")
    for mode, r in rates.items():
        print(f"{'loader, ' + mode + ', calling thread':<40}{r:>12.1f}{r / step_rate:>10.1f}")
    print(f"step waited on data: {sum(waits) * 1e3:.2f} ms over {args.steps} steps "
          f"(mean {sum(waits) / len(waits) * 1e6:.0f} us, max {max(waits) * 1e6:.0f} us per step; "
          f"{sum(waits) * step_rate / args.steps:.2%} of step time)")


if __name__ == "__main__":
    main()
