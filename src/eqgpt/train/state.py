"""`TrainState`: everything a training step reads and writes; `initial_state`: a fresh one."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from eqgpt.parallel.strategy import Strategy
from eqgpt.precision import LossScale, Policy


class TrainState(eqx.Module):
    """Model, optimizer state, step counter, a random key, and the skipped-step count.

    `step` counts batches consumed (it advances on skipped steps too, so a bad batch
    is not retried); `skipped` counts updates dropped by the non-finite guard.
    `loss_scale` is the dynamic loss scale of an fp16 policy (`Policy.loss_scale_state()`),
    `None` otherwise.
    """

    model: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    rng: PRNGKeyArray
    skipped: Int[Array, ""]
    loss_scale: LossScale | None

    def __init__(self, model: PyTree, opt_state: optax.OptState, step=0, *,
                 rng: PRNGKeyArray | jax.ShapeDtypeStruct, skipped=0,
                 loss_scale: LossScale | None = None):
        """**Arguments:** `model`, `opt_state`, `step` (default 0), `rng`, `skipped` (default 0),
        `loss_scale` (default `None`: no loss scaling). A `jax.ShapeDtypeStruct` key (and shapes for the
        model and optimizer state) make a state of shapes, which `eqgpt.plan` lowers the step from."""
        self.model = model
        self.opt_state = opt_state
        self.step = jnp.asarray(step, jnp.int32)
        self.rng = rng
        self.skipped = jnp.asarray(skipped, jnp.int32)
        self.loss_scale = loss_scale


def initial_state(optimizer: optax.GradientTransformation, strategy: Strategy, policy: Policy,
                  make_model: Callable[[PRNGKeyArray], PyTree], seed: int) -> TrainState:
    """A freshly initialised `TrainState` in the strategy's layout: the model from `make_model(key)`
    and the optimizer state, keys split from `seed`, and the policy's loss scale."""
    key_model, key_state = jax.random.split(jax.random.key(seed))
    model = strategy.init_model(make_model, key_model)
    return TrainState(model, strategy.init_opt_state(optimizer, model), rng=key_state,
                      loss_scale=policy.loss_scale_state())
