"""Shared by the parallel recipes (dp, fsdp, tp, sp, custom_rules, manual_tp, pipeline, context).

Importing it first gives JAX 8 simulated CPU devices (when no accelerator is
asked for). `train(strategy)` then does what every recipe shows: place a model
as the `Strategy` says, train a few AdamW steps with the library's one
`make_train_step` on the bytes of the standard library's `json` package, and
print the losses, the first loss on one device, and the compiled step's
collectives and memory.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqgpt  # noqa: E402
from eqgpt import nn  # noqa: E402
from eqgpt import parallel as par  # noqa: E402
from eqgpt.data import Batch  # noqa: E402
from eqgpt.profile import report  # noqa: E402
from eqgpt.train import Strategy, TrainState, make_train_step  # noqa: E402

BATCH, SEQ, STEPS = 8, 64, 5


def text_batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[Batch]:
    """`Batch`es of `[batch, seq]` bytes of the standard library's `json` package source (vocab 256)."""
    root = Path(json.__file__).parent
    data = np.frombuffer(b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))), np.uint8)
    rng = np.random.default_rng(seed)
    return [Batch.from_windows(np.stack([data[s: s + seq + 1] for s in rng.integers(0, len(data) - seq - 1, batch)])
                               .astype(np.int32)) for _ in range(steps)]


def train(strategy: Strategy, *, config: eqgpt.GPTConfig | None = None, steps: int = STEPS,
          batch: int = BATCH) -> list[float]:
    """Train `config` (default: the `nano` preset) for `steps` steps as `strategy` says; print what happened."""
    config = config or eqgpt.preset("nano", seq_len=SEQ)
    print(repr(strategy))
    make = lambda k: nn.GPT(config, key=k)  # noqa: E731
    # before compiling
    strategy.check(jax.eval_shape(make, jax.random.key(0)), batch_size=batch, seq_len=config.seq_len)
    model = strategy.init_model(make, jax.random.key(0))
    if strategy.rules.uses("params", strategy.mesh) and all(p.automatic and not p.runs_layers for p in strategy.parts):
        frac = par.check_replication(model, strategy.mesh, strategy.rules, 0.05, strategy.overrides)
        print(f"replicated parameter bytes: {frac:.2%}")  # a strategy that shards weights must really shard them
    q = model.blocks.attn.q_proj.weight
    print(f"q_proj.weight {q.shape} sharded {q.sharding.spec}; per device {q.addressable_shards[0].data.shape}")
    optimizer = optax.adamw(3e-3)
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    step = make_train_step(optimizer, strategy=strategy, model_like=model, donate=False)
    batches = [strategy.batch(b) for b in text_batches(steps, batch, config.seq_len)]
    single = eqx.filter_jit(Strategy().loss_fn())(Strategy().place_model(model), Strategy().batch(batches[0]))[0]
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for i, b in enumerate(batches):
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
        print(f"step {i}: loss {losses[-1]:.4f}")
    print(f"step 0 on one device: {float(single):.4f}")
    print(report(compiled, mesh=strategy.mesh, title=strategy.describe()))
    return losses
