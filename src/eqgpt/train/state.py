"""`TrainState`: everything a training step reads and writes."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree


class TrainState(eqx.Module):
    """Model, optimizer state, step counter, a random key, and the skipped-step count.

    `step` counts batches consumed (it advances on skipped steps too, so a bad batch
    is not retried); `skipped` counts updates dropped by the non-finite guard.
    """

    model: PyTree
    opt_state: optax.OptState
    step: Int[Array, ""]
    rng: PRNGKeyArray
    skipped: Int[Array, ""]

    def __init__(self, model: PyTree, opt_state: optax.OptState, step=0, *, rng: PRNGKeyArray, skipped=0):
        """**Arguments:** `model`, `opt_state`, `step` (default 0), `rng`, `skipped` (default 0)."""
        self.model = model
        self.opt_state = opt_state
        self.step = jnp.asarray(step, jnp.int32)
        self.rng = rng
        self.skipped = jnp.asarray(skipped, jnp.int32)
