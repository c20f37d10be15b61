"""Host offload of the optimizer state (and the parameters): they live in pinned host memory between steps.

AdamW keeps two fp32 moments per parameter, twice the parameters' own bytes. With
`Offload(opt_state=True)` those arrays stay in the `pinned_host` memory of
each device's host (same sharding, other memory kind): the compiled step copies them
to the device for the update and back afterwards. Device memory between steps drops
by the optimizer state's bytes; each step moves them host -> device -> host once
(`2 x 8 bytes` per local parameter for AdamW), which a GPU overlaps with compute.

`Offload(params=True)` does the same with the model's arrays (under FSDP
each device's shard): they are copied to the device before the forward pass, and
the updated arrays back after the update (4 bytes each way per local fp32 parameter).
Between steps the device then holds neither; inside the step, as without offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from eqgpt.parallel.part import Part

HOST = "pinned_host"


def check_host_memory() -> None:
    """A `ValueError` where the devices have no pinned host memory to offload to."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if HOST not in kinds:
        raise ValueError(f"host offload needs {HOST!r} memory, and {jax.devices()[0].platform} devices "
                         f"offer only {sorted(kinds)}; drop offload_opt_state and offload_params "
                         "(--offload-opt-state, --offload-params).")


def place_on_host(tree: PyTree) -> PyTree:
    """Each array of `tree` moved to its own sharding's `pinned_host` memory (outside `jit`)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    moved = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST)), arrays)
    return eqx.combine(moved, static)


def place_on_device(tree: PyTree) -> PyTree:
    """Each array of `tree` moved back to its sharding's device memory (outside `jit`)."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    moved = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), arrays)
    return eqx.combine(moved, static)


def to_device(tree: PyTree) -> PyTree:
    """Inside `jit`: the arrays of `tree` copied into device memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if eqx.is_array(x) else x, tree)


def to_host(tree: PyTree) -> PyTree:
    """Inside `jit`: the arrays of `tree` copied out to pinned host memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if eqx.is_array(x) else x, tree)


@dataclass(frozen=True)
class Offload(Part):
    """What lives in pinned host memory between steps: `Offload(opt_state=True, params=False)`."""

    opt_state: bool = False
    """Keep the optimizer state in pinned host memory between steps (docs/memory.md)."""
    params: bool = False
    """Keep the parameters in pinned host memory between steps too (with FSDP, each device's shard; docs/memory.md)."""

    name = "offload"
    order = 60
    needs_mesh = False

    def validate(self, strategy: Any) -> None:
        check_host_memory()

    def prepare(self, strategy: Any, model: PyTree) -> PyTree:
        return place_on_host(model) if self.params else model

    def prepare_opt_state(self, strategy: Any, opt_state: PyTree) -> PyTree:
        return place_on_host(opt_state) if self.opt_state else opt_state

    def on_device(self, strategy: Any, model: PyTree) -> PyTree:
        return place_on_device(model) if self.params else model

    def fetch_params(self, strategy: Any, model: PyTree) -> PyTree:
        return to_device(model) if self.params else model

    def stash_params(self, strategy: Any, model: PyTree) -> PyTree:
        return to_host(model) if self.params else model

    def fetch_opt_state(self, strategy: Any, opt_state: PyTree) -> PyTree:
        return to_device(opt_state) if self.opt_state else opt_state

    def stash_opt_state(self, strategy: Any, opt_state: PyTree) -> PyTree:
        return to_host(opt_state) if self.opt_state else opt_state

    def describe(self, strategy: Any) -> str:
        on_host = [what for what, flag in (("parameters", self.params), ("optimizer state", self.opt_state)) if flag]
        return f"{' and '.join(on_host)} on host"


__all__ = ["HOST", "Offload", "check_host_memory", "place_on_host", "place_on_device", "to_device", "to_host"]
