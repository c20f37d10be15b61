"""Overlap communication with compute on the automatic path: `Strategy(..., overlap=True)`.

Two things, one switch (`--overlap` in `recipes/train_gpt.py`):

1. **XLA's scheduler options** (`OVERLAP_FLAGS`), which make a GPU run collectives
   asynchronously beside compute. They live in `XLA_FLAGS`, which XLA reads once,
   when the backend starts: `set_overlap_flags()` must run before anything touches a
   device (the recipe calls it first thing). They are GPU options: the CPU and TPU
   backends accept and ignore them (TPU schedules for overlap by default).
2. **FSDP prefetch** (`PrefetchStack`): where the rules split weights over `fsdp`,
   the layer stack gathers layer `i+1`'s weights in the same loop iteration that
   runs layer `i` and carries them to the next, in the scanned and the unrolled
   stack alike. So the all-gather has a layer of compute it does not depend on,
   which an asynchronous scheduler runs it beside. In the backward pass each
   layer's weight gradient is reduce-scattered in the iteration that computes it
   (the gather's transpose pins it to the weight's sharding), not at the end.

Communication volume is unchanged: the same weights are gathered once per layer per
pass. Memory grows by one layer's gathered weights (two layers' live instead of one).
See `docs/course/17-optimizing-communication.md`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from eqgpt.parallel.auto import param_specs
from eqgpt.parallel.part import LossFn, Part

# Each flag and what it does (the docs print this table). All are XLA GPU options.
OVERLAP_FLAGS: dict[str, str] = {
    "--xla_gpu_enable_latency_hiding_scheduler=true":
        "schedule by estimated latency: start each asynchronous collective early and put independent "
        "compute between its start and its done",
    "--xla_gpu_enable_highest_priority_async_stream=true":
        "run collectives on a high-priority stream so that compute kernels do not delay them",
    "--xla_gpu_enable_pipelined_all_gather=true":
        "inside a loop over layers, move iteration i+1's all-gather into iteration i (XLA's own FSDP prefetch)",
    "--xla_gpu_enable_pipelined_reduce_scatter=true":
        "inside a loop over layers, finish iteration i's reduce-scatter during iteration i+1",
    "--xla_gpu_enable_pipelined_all_reduce=true":
        "the same for all-reduces inside loops",
    "--xla_gpu_enable_while_loop_double_buffering=true":
        "unroll loops by two so that a collective of one iteration can overlap the next one's compute",
}
WEIGHT_AXES = ("fsdp",)  # mesh axes that split weights only: their gathers are prefetched

_log = logging.getLogger(__name__)


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public query; present in jax 0.10 .. 0.12

    return bool(xla_bridge.backends_are_initialized())


def overlap_flags_set() -> bool:
    """Whether every flag of `OVERLAP_FLAGS` is in the environment's `XLA_FLAGS`."""
    current = os.environ.get("XLA_FLAGS", "").split()
    return all(f in current for f in OVERLAP_FLAGS)


def set_overlap_flags() -> bool:
    """Add `OVERLAP_FLAGS` to `XLA_FLAGS`; call before anything touches a device.

    **Returns:** whether they take effect: `False` (and nothing changes) once the
    backend has started, since XLA reads `XLA_FLAGS` only then.
    """
    if overlap_flags_set():
        return True
    if _backend_started():
        return False
    current = os.environ.get("XLA_FLAGS", "").split()
    os.environ["XLA_FLAGS"] = " ".join([*current, *(f for f in OVERLAP_FLAGS if f not in current)])
    return True


# ------------------------------------------------------------------ FSDP prefetch


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(w: Array, gathered: NamedSharding, sharded: NamedSharding) -> Array:
    """`w` in its gathered layout; the gradient goes back in the weight's own (sharded) layout,
    so each layer's gradient is reduce-scattered where it is computed."""
    return jax.lax.with_sharding_constraint(w, gathered)


def _gather_fwd(w, gathered, sharded):
    return jax.lax.with_sharding_constraint(w, gathered), None


def _gather_bwd(gathered, sharded, _, g):
    return (jax.lax.with_sharding_constraint(g, sharded),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _without(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    def entry(e):
        kept = tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(entry(e) for e in spec))


class PrefetchStack(eqx.Module):
    """The model's activation hook, also running its layer stack with prefetched weights.

    `eqgpt.nn.GPT` runs its layers through `run_stack` when its `shard` hook has one
    (else `jax.lax.scan`). This one gathers layer `i+1`'s weights in the iteration of
    layer `i` and carries them (see module docs).

    **Fields:** `inner` (the hook it stands in for), `mesh`, and per array of one
    layer (in `jax.tree.leaves` order) its `sharded` and `gathered` specs.
    """

    inner: eqx.Module
    mesh: Mesh = eqx.field(static=True)
    sharded: tuple[PartitionSpec, ...] = eqx.field(static=True)
    gathered: tuple[PartitionSpec, ...] = eqx.field(static=True)
    _is_constraint: ClassVar[bool] = True

    def __call__(self, x: Array, names: tuple[str | None, ...]) -> Array:
        """The activation constraint of `inner`."""
        return self.inner(x, names)

    def _gather(self, layer: list[Array]) -> list[Array]:
        return [_gather(w, NamedSharding(self.mesh, g), NamedSharding(self.mesh, s))
                for w, g, s in zip(layer, self.gathered, self.sharded, strict=True)]

    def run_stack(self, layer: Callable, x: PyTree, stacked: PyTree, *, unroll: int | bool = 1):
        """`jax.lax.scan(layer, x, stacked, unroll=unroll)`, with layer `i+1`'s weights gathered
        while layer `i` runs. **Returns:** `(x, ys)` as the scan would."""
        leaves, tree = jax.tree.flatten(stacked)
        if len(leaves) != len(self.gathered):
            raise ValueError(f"PrefetchStack holds specs for {len(self.gathered)} arrays per layer, the stack "
                             f"has {len(leaves)}; install it with install_prefetch on the model it runs.")
        first = self._gather([w[0] for w in leaves])

        def step(carry, nxt):
            h, weights = carry
            upcoming = self._gather(nxt)  # issued before this layer's compute, needed by the next
            h, ys = layer(h, tree.unflatten(weights))
            return (h, upcoming), ys

        (x, last), ys = jax.lax.scan(step, (x, first), [w[1:] for w in leaves], unroll=unroll)
        x, y_last = layer(x, tree.unflatten(last))
        return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y_last)


def prefetch_axes(strategy: Any) -> tuple[str, ...]:
    """The mesh axes whose weight gathers `overlap` prefetches (`fsdp` where the rules use it)."""
    if strategy.mesh is None:
        return ()
    used = strategy.param_rules.uses("params", strategy.mesh)
    return tuple(a for a in WEIGHT_AXES if a in used and strategy.mesh.shape[a] > 1)


def install_prefetch(model: PyTree, strategy: Any) -> PyTree:
    """`model` whose `shard` hook is a `PrefetchStack` for `strategy` (unchanged when the
    strategy splits no weights over a `WEIGHT_AXES` axis, or the model has no `shard` and `blocks`)."""
    axes = prefetch_axes(strategy)
    if not axes or not (hasattr(model, "shard") and hasattr(model, "blocks")):
        return model
    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    specs = param_specs(model, strategy.param_rules, strategy.overrides, mesh=strategy.mesh).blocks
    arrays = jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array))
    specs = [s for s in jax.tree.leaves(specs, is_leaf=is_spec) if is_spec(s)]
    layer = [PartitionSpec(*(tuple(s) + (None,) * (a.ndim - len(s)))[1:]) for s, a in zip(specs, arrays, strict=True)]
    return eqx.tree_at(lambda m: m.shard, model,
                       PrefetchStack(model.shard, strategy.mesh, tuple(layer), tuple(_without(s, axes) for s in layer)))


class OverlapPart(Part):
    """`Strategy(overlap=True)`: XLA's overlap flags checked, FSDP weight gathers prefetched."""

    name = "overlap"
    needs_mesh = False  # harmless on one device: nothing to overlap

    @classmethod
    def of(cls, strategy: Any) -> OverlapPart | None:
        return cls() if strategy.overlap else None

    def validate(self, strategy: Any) -> None:
        if not overlap_flags_set():
            platform = (strategy.mesh.devices.flat[0] if strategy.mesh is not None else jax.devices()[0]).platform
            if platform == "gpu":
                raise ValueError(
                    "overlap=True on GPU needs XLA's scheduler flags, which XLA reads when the backend starts: "
                    "call eqgpt.parallel.overlap.set_overlap_flags() before any JAX device use (the recipe's "
                    "--overlap does), or put them in XLA_FLAGS: " + " ".join(OVERLAP_FLAGS))
            _log.info("overlap: XLA's GPU scheduler flags are not set; on %s they would change nothing", platform)

    def loss_fn(self, strategy: Any, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        if not prefetch_axes(strategy) or not all(p.automatic for p in strategy.parts) or strategy.pipeline:
            return loss  # nothing to prefetch, or the layers run elsewhere (manual path, pipeline)

        def prefetched(model, batch):
            return loss(install_prefetch(model, strategy), batch)

        return prefetched

    def describe(self, strategy: Any) -> str:
        return "overlap"


__all__ = ["OVERLAP_FLAGS", "OverlapPart", "PrefetchStack", "install_prefetch", "overlap_flags_set",
           "prefetch_axes", "set_overlap_flags"]
