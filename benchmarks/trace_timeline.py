"""Trace two `fsdp+tp` training steps on 8 simulated CPU devices; print the tables; draw the timeline.

This makes the picture and the tables of `docs/profiling.md` from a real trace:
`python benchmarks/trace_timeline.py [--out docs/img/trace_timeline.png] [--log-dir /tmp/eqgpt-trace]`.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqgpt  # noqa: E402
import eqgpt.parallel as par  # noqa: E402
from eqgpt import nn  # noqa: E402
from eqgpt.data.batch import Batch  # noqa: E402
from eqgpt.profile import trace as T  # noqa: E402
from eqgpt.train import Strategy, TrainState, make_train_step  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="docs/img/trace_timeline.png")
    p.add_argument("--log-dir", default="/tmp/eqgpt-trace")
    p.add_argument("--mesh", default="fsdp=4,tensor=2")
    p.add_argument("--strategy", default="fsdp+tp")
    args = p.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)

    cfg = eqgpt.GPTConfig(vocab_size=256, seq_len=64, num_layers=2, num_heads=4, embed_dim=128)
    strategy = Strategy(par.make_mesh(args.mesh), args.strategy)
    opt = optax.adamw(1e-3)
    model = strategy.init_model(lambda k: nn.GPT(cfg, key=k), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(opt, model), rng=jax.random.key(0))
    step = make_train_step(opt, strategy=strategy, model_like=model, donate=False)
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (16, cfg.seq_len + 1)).astype(np.int32)
    batch = strategy.batch(Batch.from_windows(windows))
    compiled = step.lower(state, batch).compile()
    window = T.ProfileWindow(2, 4, args.log_dir)
    for i in range(4):
        state, _ = window.run(i, compiled, state, batch)
    window.close()
    print(f"trace: {T.trace_files(args.log_dir)}; memory profile: {window.memory_profile}")
    print(T.breakdown_table(args.log_dir, title=f"{args.strategy} on {args.mesh}"))
    print(T.op_table(args.log_dir, hlo_text=compiled, top=10))
    out = T.plot_timeline(args.log_dir, args.out, title=f"one {args.strategy} step on {args.mesh} (8 CPU devices)")
    print(f"timeline: {out}")


if __name__ == "__main__":
    main()
