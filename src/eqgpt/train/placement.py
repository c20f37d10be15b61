"""Placement: where a model, its optimizer state and each batch live.

The trainer calls only these three methods, so it knows no parallel strategy.
`SingleDevice` puts everything on one device; `eqgpt.parallel.ShardedPlacement`
implements the same methods for a mesh and a rule set.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import PRNGKeyArray, PyTree


class SingleDevice:
    """Everything on one device (default: the first).

    **Arguments:** `device`, a `jax.Device` or `None`.
    """

    def __init__(self, device: jax.Device | None = None):
        self.device = jax.devices()[0] if device is None else device
        self.sharding = jax.sharding.SingleDeviceSharding(self.device)

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, built by a compiled function directly on the device."""
        with jax.default_device(self.device):
            return eqx.filter_jit(make)(key)

    def init_opt_state(self, optimizer: optax.GradientTransformation, model: PyTree) -> optax.OptState:
        """`optimizer.init` of the model's arrays, on the model's device."""
        with jax.default_device(self.device):
            return eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_array))

    def batch(self, local: PyTree) -> PyTree:
        """Global arrays from this process's rows (an array or a pytree of arrays)."""

        def one(x):
            x = np.asarray(x)
            global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            return jax.make_array_from_process_local_data(self.sharding, x, global_shape)

        return jax.tree.map(one, local)

    def __repr__(self) -> str:
        return f"SingleDevice({self.device})"
