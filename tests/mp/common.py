"""One tiny training set-up shared by the multi-process workers and the tests that check them.

Everything is a pure function of its arguments, so a 2-process run and a
1-process run build the same model, optimizer and batches.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import eqgpt
from eqgpt.data import BatchLoader
from eqgpt.nn import GPT
from eqgpt.parallel import ShardedPlacement, make_mesh
from eqgpt.train import TrainState, make_train_step

CONFIG = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=4, embed_dim=32)
BATCH = 8
OPTIMIZER = optax.adamw(3e-3, weight_decay=0.1)


def corpus() -> np.ndarray:
    """Synthetic tokens with structure to learn (a noisy counter)."""
    rng = np.random.default_rng(0)
    base = np.arange(20_000) % CONFIG.vocab_size
    noise = rng.integers(0, CONFIG.vocab_size, base.shape) * (rng.random(base.shape) < 0.2)
    return ((base + noise) % CONFIG.vocab_size).astype(np.int32)


def setup(mesh: str, strategy: str, seed: int = 0, config: eqgpt.GPTConfig = CONFIG):
    """`(placement, state, step_fn, loader)` for a mesh spec and strategy over all devices."""
    placement = ShardedPlacement(make_mesh(mesh), strategy)
    key_model, key_state = jax.random.split(jax.random.key(seed))
    model = placement.init_model(lambda k: GPT(config, key=k), key_model)
    # step, rng and skipped replicated on the mesh, as the step returns them (no second compile).
    replicated = NamedSharding(placement.mesh, PartitionSpec())
    state = TrainState(model, placement.init_opt_state(OPTIMIZER, model), rng=key_state)
    put = lambda x: jax.device_put(np.asarray(x), replicated)  # noqa: E731 (host values: any process count)
    state = eqx.tree_at(lambda s: (s.step, s.rng, s.skipped), state,
                        (put(state.step), jax.random.wrap_key_data(put(jax.random.key_data(state.rng))),
                         put(state.skipped)))
    loader = BatchLoader(corpus(), batch_size=BATCH, seq_len=config.seq_len, seed=seed)
    return placement, state, make_train_step(OPTIMIZER), loader


def train(state, step_fn, loader, placement, steps: int):
    """Run `steps` steps from `state.step`; **returns** `(state, losses)`."""
    losses = []
    start = int(state.step)
    for s in range(start, start + steps):
        state, metrics = step_fn(state, placement.batch(loader.local_batch(s)))
        losses.append(float(metrics["loss"]))
    return state, losses
