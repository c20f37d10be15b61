"""The training step compiled from shapes alone, for any devices (a slice's compile-only TPUs).

`compile_step` builds the model, optimizer state and batch as `jax.ShapeDtypeStruct`s laid out
by the strategy (`Strategy.place_model` and `place_opt_state` accept shapes), then lowers the
very step `make_train_step` gives the trainer (`eqgpt.train.lower_from_shapes`) and compiles it.
Nothing is allocated, so a 70B model compiles for a 256-chip slice on a laptop. The fit check is
the trainer's own (`eqgpt.train.fit.check_fits`): the same one-line `DoesNotFit` error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from eqgpt.config import GPTConfig
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.parallel.strategy import Strategy
from eqgpt.precision import Policy
from eqgpt.train.fit import check_fits
from eqgpt.train.state import TrainState
from eqgpt.train.step import lower_from_shapes, make_train_step


def _shape_only(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def shape_state(strategy: Strategy, make_model: Callable, optimizer: optax.GradientTransformation,
                policy: Policy) -> TrainState:
    """The `TrainState` of `make_model` and `optimizer` as shapes with the strategy's shardings
    (step counters, key and loss scale replicated)."""
    model = strategy.place_model(eqx.filter_eval_shape(make_model, jax.random.key(0)))
    opt_shapes = eqx.filter_eval_shape(optimizer.init, eqx.filter(model, _shape_only))
    state = TrainState(model, strategy.place_opt_state(opt_shapes, model),
                       rng=jax.eval_shape(lambda: jax.random.key(0)), loss_scale=policy.loss_scale_state())
    replicated = NamedSharding(strategy.mesh, PartitionSpec())

    def shape(x):
        if isinstance(x, jax.Array) or (_shape_only(x) and x.sharding is None):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
        return x

    return jax.tree.map(shape, state, is_leaf=_shape_only)


def shape_batch(strategy: Strategy, rows: int, seq_len: int) -> Batch:
    """A global batch of `rows` windows as shapes, laid out as the strategy's loss expects."""
    windows = jax.ShapeDtypeStruct((rows, seq_len + 1), np.int32)
    return strategy.batch(jax.eval_shape(Batch.from_windows, windows))


def compile_step(model_cfg: GPTConfig, strategy: Strategy, policy: Policy, optimizer: optax.GradientTransformation,
                 *, batch_size: int, accum_steps: int = 1, z_loss: float = 0.0, block_factory: Any = None,
                 hbm_bytes: int | None = None) -> Any:
    """The trainer's step for `model_cfg` under `strategy`, compiled for the strategy's mesh from shapes.

    **Arguments:** the model's config (and `block_factory`), the strategy (its mesh over the target
    devices), the precision `policy`, the `optimizer`, the global `batch_size`, `accum_steps`,
    `z_loss`; `hbm_bytes`, the memory of one device: a step that needs more raises the trainer's
    `DoesNotFit`. Sizes the strategy cannot split raise its `ValueError` before anything compiles.

    **Returns:** the compiled step (`jax.stages.Compiled`).
    """
    def make(key):
        return policy.cast_to_param(GPT(model_cfg, key=key, block_factory=block_factory))

    model_like = jax.eval_shape(make, jax.random.key(0))
    strategy.check(model_like, batch_size=batch_size, seq_len=model_cfg.seq_len, accum_steps=accum_steps)
    state = shape_state(strategy, make, optimizer, policy)
    batch = shape_batch(strategy, batch_size, model_cfg.seq_len)
    step = make_train_step(optimizer, strategy=strategy, policy=policy, accum_steps=accum_steps, z_loss=z_loss,
                           model_like=model_like)
    build = lambda: lower_from_shapes(step, state, batch).compile()  # noqa: E731
    if hbm_bytes is None:
        return build()
    return check_fits(build, what=f"the training step at --batch-size {batch_size}", limit=hbm_bytes)


__all__ = ["shape_state", "shape_batch", "compile_step"]
