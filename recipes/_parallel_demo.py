"""Shared by the parallel recipes (dp, fsdp, tp, sp, custom_rules, manual_tp, pipeline, context).

Importing it first gives JAX 8 simulated CPU devices (when no accelerator is
asked for). `train(mesh, rules)` then does what every recipe shows: place the
`nano` model by the rules, train a few AdamW steps on the bytes of the standard
library's `json` package, and print the losses and the compiled step's collectives and memory.
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
from eqgpt.profile import report  # noqa: E402

BATCH, SEQ, STEPS = 8, 64, 5


def text_batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[np.ndarray]:
    """`[batch, seq + 1]` windows of the standard library's `json` package source, as bytes (vocab 256)."""
    root = Path(json.__file__).parent
    data = np.frombuffer(b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))), np.uint8)
    rng = np.random.default_rng(seed)
    return [np.stack([data[s: s + seq + 1] for s in rng.integers(0, len(data) - seq - 1, batch)]).astype(np.int32)
            for _ in range(steps)]


def train(mesh, rules, overrides=None, *, config: eqgpt.GPTConfig | None = None, steps: int = STEPS):
    """Train `config` (default: the `nano` preset) for `steps` steps on `mesh` by `rules`; print what happened."""
    config = config or eqgpt.preset("nano")
    rules = par.preset_rules(rules)
    print(f"mesh {dict((k, v) for k, v in mesh.shape.items() if v > 1)} | rules {rules.name}")
    par.check_divisibility(config, mesh, rules, BATCH, SEQ, overrides)  # ValueError before compiling

    placement = par.ShardedPlacement(mesh, rules, overrides)
    model = placement.init_model(lambda k: nn.GPT(config, key=k), jax.random.key(0))
    if rules.uses("params", mesh):  # a strategy that shards weights must really shard them
        frac = par.check_replication(model, mesh, rules, max_fraction=0.05, overrides=overrides)
        print(f"replicated parameter bytes: {frac:.2%}")
    optimizer = optax.adamw(3e-3)
    opt_state = placement.init_opt_state(optimizer, model)
    q = model.blocks.attn.q_proj.weight
    print(f"q_proj.weight {q.shape} sharded {q.sharding.spec}; per device {q.addressable_shards[0].data.shape}")

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(lambda m: nn.lm_loss(m, x, y)[0])(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    # Inputs and targets, each a global [batch, seq] array split as the rules say.
    batches = [(placement.batch(b[:, :-1]), placement.batch(b[:, 1:])) for b in text_batches(steps, BATCH, SEQ)]
    compiled = step.lower(model, opt_state, *batches[0]).compile()
    for i, (x, y) in enumerate(batches):
        model, opt_state, loss = compiled(model, opt_state, x, y)
        print(f"step {i}: loss {float(loss):.4f}")
    print(report(compiled, mesh=mesh, title=rules.name))
    return model
