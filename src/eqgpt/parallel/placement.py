"""`ShardedPlacement`: the placement contract (see `docs/design.md`) for a device mesh.

The trainer asks a placement for three things and knows nothing else about
devices: a model (`init_model`), its optimizer state (`init_opt_state`), and
global batches from this process's rows (`batch`). This one lays them out by a
rule set on a mesh; `eqgpt.train` has the single-device one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PRNGKeyArray, PyTree

from eqgpt.parallel.rules import Rules, strategy
from eqgpt.parallel.shard import (
    batch_sharding,
    init_opt_state_sharded,
    init_sharded,
    shard_model,
    shard_opt_state,
)


class ShardedPlacement:
    """Places models, optimizer states and batches on `mesh` by `rules`.

    **Arguments:**

    - `mesh`: a mesh from `eqgpt.parallel.make_mesh`.
    - `rules`: a `Rules` or a strategy string such as `"fsdp+tp"`.
    - `overrides`: per-module rule sets, keyed by dotted module path.
    """

    def __init__(self, mesh: Mesh, rules: Rules | str, overrides: Mapping[str, Rules] | None = None):
        self.mesh = mesh
        self.rules = strategy(rules)
        self.overrides = dict(overrides or {})

    def __repr__(self) -> str:
        return f"ShardedPlacement(mesh={dict(self.mesh.shape)}, rules={self.rules.name!r})"

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, initialised directly in its sharding, with activation constraints."""
        return init_sharded(make, key, self.mesh, self.rules, self.overrides)

    def place_model(self, model: PyTree) -> PyTree:
        """An existing model moved to its sharding, with activation constraints."""
        return shard_model(model, self.mesh, self.rules, self.overrides)

    def init_opt_state(self, optimizer: Any, model: PyTree) -> PyTree:
        """`optimizer.init` of the model's arrays, each moment created in its parameter's sharding."""
        return init_opt_state_sharded(optimizer, model, self.mesh, self.rules, self.overrides)

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """An existing optimizer state moved next to its parameters."""
        return shard_opt_state(opt_state, model, self.mesh, self.rules, self.overrides)

    def batch_sharding(self, ndim: int = 2, shape: tuple[int, ...] | None = None) -> NamedSharding:
        """Sharding of global `[batch, seq]` (or `[batch]`) arrays (see `eqgpt.parallel.batch_sharding`)."""
        return batch_sharding(self.mesh, self.rules, ndim, shape)

    def batch(self, local: PyTree) -> PyTree:
        """Global `jax.Array`s from this process's rows (a `[rows, seq]` array or a pytree of them).

        With several processes, each passes its own contiguous rows; the global
        batch is their concatenation in process order.
        """

        def one(x):
            x = np.asarray(x)
            if x.ndim not in (1, 2):
                raise ValueError(f"batch arrays must be [batch] or [batch, seq]; got shape {x.shape}.")
            global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            sharding = self.batch_sharding(x.ndim, global_shape)
            return jax.make_array_from_process_local_data(sharding, x, global_shape)

        return jax.tree.map(one, local)
