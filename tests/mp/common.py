"""One tiny training set-up shared by the subprocess workers and the tests that check them.

Everything is a pure function of its arguments, so a 2-process run, a
1-process run and a resumed run build the same model, optimizer and batches.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import eqgpt
from eqgpt.data import BatchLoader
from eqgpt.nn import GPT, NoConstraint, map_constraints
from eqgpt.parallel import (
    ShardedPlacement,
    make_mesh,
    opt_state_shardings,
    param_shardings,
    with_constraints,
)
from eqgpt.train import (
    Trainer,
    TrainerConfig,
    TrainState,
    make_lr_schedule,
    make_optimizer,
    make_train_step,
)

CONFIG = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=4, embed_dim=32)
BATCH = 8
TOTAL_STEPS = 20
OPTIMIZER = make_optimizer(make_lr_schedule(3e-3, total_steps=TOTAL_STEPS, warmup_steps=2))


def corpus() -> np.ndarray:
    """Synthetic tokens with structure to learn (a noisy counter)."""
    rng = np.random.default_rng(0)
    base = np.arange(20_000) % CONFIG.vocab_size
    noise = rng.integers(0, CONFIG.vocab_size, base.shape) * (rng.random(base.shape) < 0.2)
    return ((base + noise) % CONFIG.vocab_size).astype(np.int32)


def host_model(seed: int = 0) -> GPT:
    """A GPT with GPT-2-like initial values drawn on the host by NumPy.

    Building it costs no compilation (the tests compare runs with one another, so
    any fixed initialisation serves); norms start at 1, biases at 0.
    """
    rng = np.random.default_rng(seed)
    skeleton = eqx.filter_eval_shape(lambda k: GPT(CONFIG, key=k), jax.random.key(0))

    def fill(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        name = ".".join(str(getattr(k, "name", k)) for k in path)
        if name.endswith("bias"):
            return np.zeros(x.shape, x.dtype)
        if "norm" in name:
            return np.ones(x.shape, x.dtype)
        return (0.02 * rng.standard_normal(x.shape)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(fill, skeleton)


def setup(mesh: str, strategy: str, seed: int = 0, devices=None):
    """`(placement, state, step_fn, loader)` for a mesh spec and strategy over `devices` (default all)."""
    placement = ShardedPlacement(make_mesh(mesh, devices=devices), strategy)
    model = placement.place_model(host_model(seed))
    key_state = jax.random.key(seed + 1)
    state = TrainState(model, placement.init_opt_state(OPTIMIZER, model), rng=key_state)
    state = _state(state.model, state.opt_state, *_replicated(state, placement))
    loader = BatchLoader(corpus(), batch_size=BATCH, seq_len=CONFIG.seq_len, seed=seed)
    return placement, state, step_fn(), loader


_STEP = []


def step_fn():
    """One compiled step per process: runs with the same shardings share its compilation."""
    if not _STEP:
        _STEP.append(make_train_step(OPTIMIZER))
    return _STEP[0]


def _replicated(state: TrainState, placement: ShardedPlacement):
    """step, rng and skipped replicated on the mesh, as the step returns them (no second compile)."""
    replicated = NamedSharding(placement.mesh, PartitionSpec())
    put = lambda x: jax.device_put(np.asarray(x), replicated)  # noqa: E731 (host values: any process count)
    key = jax.random.wrap_key_data(put(jax.random.key_data(state.rng)))
    return put(state.step), key, put(state.skipped)


def train(state, step_fn, loader, placement, steps: int):
    """Run `steps` steps from `state.step` in a plain loop; **returns** `(state, losses)`."""
    losses = []
    start = int(state.step)
    for s in range(start, start + steps):
        state, metrics = step_fn(state, placement.batch(loader.local_batch(s)))
        losses.append(float(metrics["loss"]))
    return state, losses


def trainer(state, step_fn, loader, placement, *, steps: int, checkpointer=None) -> Trainer:
    """The library's `Trainer`, logging every step's loss, without validation or a progress bar."""
    config = TrainerConfig(steps=steps, log_every=1, eval_every=0, progress=False)
    return Trainer(step_fn, state, loader, placement, config=config, checkpointer=checkpointer)


def losses(t: Trainer) -> list[float]:
    return [row["loss"] for row in t.history.rows if "loss" in row]


def target(like: TrainState, placement: ShardedPlacement | None) -> TrainState:
    """A restore target on `placement` (`None`: one device) with `like`'s shapes; allocates nothing.

    The optimizer state is re-derived from the target model: its moments mirror the
    model's structure, activation hooks (which name the mesh) included.
    """
    bare = map_constraints(like.model, lambda path, hook: NoConstraint())  # hooks of no mesh
    if placement is not None:
        bare = with_constraints(bare, placement.mesh, placement.rules)
    model = eqx.filter(bare, eqx.is_array)
    opt = eqx.filter_eval_shape(OPTIMIZER.init, model)
    if placement is None:
        one = SingleDeviceSharding(jax.devices()[0])
        m_sh, o_sh, scalar = jax.tree.map(lambda _: one, model), jax.tree.map(lambda _: one, opt), one
    else:
        mesh, rules = placement.mesh, placement.rules
        m_sh = param_shardings(model, mesh, rules)
        o_sh = opt_state_shardings(opt, model, mesh, rules)
        scalar = NamedSharding(mesh, PartitionSpec())
    abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    model = eqx.combine(jax.tree.map(abstract, model, m_sh), eqx.filter(bare, eqx.is_array, inverse=True))
    return _state(model, jax.tree.map(abstract, opt, o_sh), abstract(like.step, scalar),
                  abstract(like.rng, scalar), abstract(like.skipped, scalar))


def _state(model, opt_state, step, rng, skipped) -> TrainState:
    # TrainState.__init__ converts step/skipped with jnp.asarray; set the abstract leaves directly.
    state = TrainState(model, opt_state, rng=rng)
    return eqx.tree_at(lambda s: (s.step, s.skipped), state, (step, skipped))
