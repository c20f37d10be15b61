"""Placements: where a model, its optimizer state and each batch live.

`Placement` is the contract (a `Protocol`): the trainer, the checkpointer and
the recipes ask it for models, optimizer states and global batches, and know
nothing else about devices. `SingleDevice` puts everything on one device;
`ShardedPlacement` lays everything out by a rule set on a mesh. A `Strategy`
(`eqgpt.parallel.strategy`) picks the placement its parallelism needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PRNGKeyArray, PyTree

import eqgpt.parallel.auto as auto
from eqgpt.nn.axes import NoConstraint, map_constraints
from eqgpt.parallel.rules import Rules, entry_axes, preset_rules


@runtime_checkable
class Placement(Protocol):
    """Where models, optimizer states and batches live.

    - `mesh`: the device mesh, or `None` on one device.
    - `init_model(make, key)`: `make(key)` built directly where it lives.
    - `place_model(model)`: an existing model moved there.
    - `init_opt_state(optimizer, model)` / `place_opt_state(opt_state, model)`: the same
      for the optimizer state (moments next to their parameters).
    - `batch(local)`: global arrays from this process's rows (any pytree, e.g. a `Batch`).
    - `batch_divisor`: the number of pieces the batch's rows are split into.
    """

    mesh: Mesh | None

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree: ...

    def place_model(self, model: PyTree) -> PyTree: ...

    def init_opt_state(self, optimizer: optax.GradientTransformation, model: PyTree) -> PyTree: ...

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree: ...

    def batch(self, local: PyTree) -> PyTree: ...

    @property
    def batch_divisor(self) -> int: ...


def _global_rows(x: Any, sharding_of: Callable[[int, tuple[int, ...]], jax.sharding.Sharding]
                 ) -> jax.Array | jax.ShapeDtypeStruct:
    """One global array from this process's rows; a `jax.ShapeDtypeStruct` (shapes only) stays one, with
    its sharding (its rows are already the global batch's)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x.ndim, tuple(x.shape)))
    x = np.asarray(x)
    global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    return jax.make_array_from_process_local_data(sharding_of(x.ndim, global_shape), x, global_shape)


class SingleDevice:
    """Everything on one device (default: the first).

    **Arguments:** `device`, a `jax.Device` or `None`.
    """

    mesh = None
    batch_divisor = 1

    def __init__(self, device: jax.Device | None = None):
        self.device = jax.devices()[0] if device is None else device
        self.sharding = jax.sharding.SingleDeviceSharding(self.device)

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, built by a compiled function directly on the device, its arrays committed
        there as a step's outputs are: a jitted function called with both compiles once."""
        return eqx.filter_jit(make)(jax.device_put(key, self.sharding))

    def place_model(self, model: PyTree) -> PyTree:
        """The model's arrays moved to the device, its activation hooks back to no constraint."""
        model = map_constraints(model, lambda _path, _hook: NoConstraint())
        arrays, static = eqx.partition(model, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self.sharding), static)

    def init_opt_state(self, optimizer: optax.GradientTransformation, model: PyTree) -> PyTree:
        """`optimizer.init` of the model's arrays, on the model's device."""
        with jax.default_device(self.device):
            return eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_array))

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """The optimizer state's arrays moved to the device."""
        arrays, static = eqx.partition(opt_state, eqx.is_array)
        return eqx.combine(jax.device_put(arrays, self.sharding), static)

    def batch(self, local: PyTree) -> PyTree:
        """Global arrays from this process's rows (an array or a pytree of arrays, e.g. a `Batch`)."""
        return jax.tree.map(lambda x: _global_rows(x, lambda _n, _s: self.sharding), local)

    def __repr__(self) -> str:
        return f"SingleDevice({self.device})"


class ShardedPlacement:
    """Places models, optimizer states and batches on `mesh` by `rules`.

    **Arguments:**

    - `mesh`: a mesh from `eqgpt.parallel.make_mesh`.
    - `rules`: a `Rules` or a strategy string such as `"fsdp+tp"`.
    - `overrides`: per-module rule sets, keyed by dotted module path.
    """

    def __init__(self, mesh: Mesh, rules: Rules | str, overrides: Mapping[str, Rules] | None = None):
        self.mesh: Mesh | None = mesh
        self.rules = preset_rules(rules)
        self.overrides = dict(overrides or {})

    def __repr__(self) -> str:
        return f"ShardedPlacement(mesh={dict(self.mesh.shape)}, rules={self.rules.name!r})"

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, initialised directly in its sharding, with activation constraints."""
        return auto.init_sharded(make, key, self.mesh, self.rules, self.overrides)

    def place_model(self, model: PyTree) -> PyTree:
        """An existing model moved to its sharding, with activation constraints."""
        return auto.place_model(model, self.mesh, self.rules, self.overrides)

    def init_opt_state(self, optimizer: Any, model: PyTree) -> PyTree:
        """`optimizer.init` of the model's arrays, each moment created in its parameter's sharding."""
        return auto.init_opt_state_sharded(optimizer, model, self.mesh, self.rules, self.overrides)

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """An existing optimizer state moved next to its parameters."""
        return auto.place_opt_state(opt_state, model, self.mesh, self.rules, self.overrides)

    def batch_sharding(self, ndim: int = 2, shape: tuple[int, ...] | None = None) -> NamedSharding:
        """Sharding of global `[batch, seq]` (or `[batch]`) arrays (see `eqgpt.parallel.batch_sharding`)."""
        return auto.batch_sharding(self.mesh, self.rules, ndim, shape)

    @property
    def batch_divisor(self) -> int:
        """Devices the batch's rows are split over (the `batch` activation rule)."""
        spec = self.rules.spec(("batch",), "activations", mesh=self.mesh)
        return int(np.prod([self.mesh.shape[a] for a in entry_axes(spec[0])]))

    def batch(self, local: PyTree) -> PyTree:
        """Global `jax.Array`s from this process's rows (a `[rows, seq]` array or a pytree of them, e.g. a `Batch`).

        With several processes, each passes its own contiguous rows; the global
        batch is their concatenation in process order.
        """

        def one(x):
            if np.ndim(x) not in (1, 2):
                raise ValueError(f"batch arrays must be [batch] or [batch, seq]; got shape {np.shape(x)}.")
            return _global_rows(x, lambda ndim, shape: self.batch_sharding(ndim, shape))

        return jax.tree.map(one, local)
