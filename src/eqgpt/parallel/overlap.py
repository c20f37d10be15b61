"""Overlap communication with compute on the automatic path: the `Overlap` part.

Two things, one switch (`--overlap` in `recipes/train_gpt.py`):

1. **XLA's scheduler options** (`OVERLAP_FLAGS`), which make a GPU run collectives
   asynchronously beside compute. They live in `XLA_FLAGS`, which XLA reads once,
   when the backend starts: `set_overlap_flags()` must run before anything touches a
   device (the recipe calls it first thing). They are GPU options: the CPU and TPU
   backends accept and ignore them (TPU schedules for overlap by default).
2. **FSDP prefetch** (`PrefetchStack`): where the rules split weights over `fsdp`,
   the layer stack gathers layer `i+1`'s weights in the loop iteration that runs
   layer `i` and carries them to the next, in the scanned and the unrolled stack
   alike; the backward pass, in reverse, gathers layer `i-1`'s weights while layer
   `i`'s gradient is computed. So each all-gather has a layer of compute it does not
   depend on, which an asynchronous scheduler runs it beside. Each layer's weight
   gradient is reduce-scattered in the iteration that computes it, not at the end.

   A custom VJP does this: the forward keeps each layer's VJP residuals *except* its
   gathered weights, and the backward gathers them again (as FSDP does without
   prefetch), so communication volume and memory stay those of FSDP, plus one more
   layer's gathered weights alive at a time.

See `docs/course/17-optimizing-communication.md`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from eqgpt.nn.axes import ActivationHook
from eqgpt.nn.gpt import GPT
from eqgpt.parallel.auto import param_specs
from eqgpt.parallel.part import LossFn, Part
from eqgpt.parallel.rules import entry_axes, is_spec

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

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


def _without(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    def entry(e):
        kept = tuple(a for a in entry_axes(e) if a not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(entry(e) for e in spec))


def _hoist(fn: Callable, *example: Any) -> tuple[Callable, list]:
    """`fn` with every value it closes over (the positions and masks the model's layer
    reads) as trailing arguments, and those values: a custom VJP may not close over them."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*example)
    out_tree = jax.tree.structure(shape)
    if any(isinstance(c, jax.core.Tracer) and jnp.issubdtype(c.dtype, jnp.inexact) for c in closed.consts):
        raise ValueError("overlap's FSDP prefetch runs layers that read only their weights and integer inputs "
                         "(positions, segment ids); this layer also reads a float array from outside, which would "
                         "get no gradient. Pass it in the layer's weights, or drop overlap.")

    def explicit(*args):
        n = len(args) - len(closed.consts)
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, args[n:], *jax.tree.leaves(args[:n])))

    return explicit, list(closed.consts)


class _PrefetchPlan:
    """What the custom VJP of one prefetched stack needs besides arrays (hashed by identity)."""

    def __init__(self, stack: PrefetchStack, layer: Callable, unroll: int | bool):
        self.stack, self.layer, self.unroll = stack, layer, unroll
        self.residuals = None  # (treedef of a layer's VJP, per residual: the weight it is, or None)

    def gather(self, weights: list[Array]) -> list[Array]:
        return [jax.lax.with_sharding_constraint(w, NamedSharding(self.stack.mesh, g))
                for w, g in zip(weights, self.stack.gathered, strict=True)]

    def scatter(self, grads: list[Array]) -> list[Array]:
        return [jax.lax.with_sharding_constraint(g, NamedSharding(self.stack.mesh, s))
                for g, s in zip(grads, self.stack.sharded, strict=True)]

    def apply(self, h, weights, consts, keep: bool):
        """One layer; with `keep`, also its VJP's residuals other than the gathered weights."""
        if not keep:
            return self.layer(h, weights, *consts), []
        out, vjp = jax.vjp(lambda h, w: self.layer(h, w, *consts), h, weights)
        res, tree = jax.tree.flatten(vjp)
        where = tuple(next((k for k, w in enumerate(weights) if r is w), None) for r in res)
        if self.residuals is None:  # the same layer computation each time: one structure serves all
            self.residuals = (tree, where)
        elif (self.residuals[0].num_leaves, self.residuals[1]) != (tree.num_leaves, where):
            raise ValueError("a layer's VJP residuals differ between layers of one stack; run it without overlap.")
        return out, [r for r, k in zip(res, where, strict=True) if k is None]

    def forward(self, x, leaves, consts, keep: bool):
        """Layers `0..L-2` in a scan, each gathering the next layer's weights, then the last.
        **Returns:** `((x, ys), (kept of layers 0..L-2 stacked, kept of the last))`."""
        def step(carry, upcoming):
            h, weights = carry
            upcoming = self.gather(upcoming)  # issued before this layer's compute, needed by the next
            (h, ys), kept = self.apply(h, weights, consts, keep)
            return (h, upcoming), (ys, kept)

        first = self.gather([w[0] for w in leaves])
        (x, last), (ys, kept) = jax.lax.scan(step, (x, first), [w[1:] for w in leaves], unroll=self.unroll)
        (x, y_last), kept_last = self.apply(x, last, consts, keep)
        return (x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y_last)), (kept, kept_last)

    def layer_grad(self, dh, g_y, weights, kept, consts):
        tree, where = self.residuals
        kept = iter(kept)
        vjp = jax.tree.unflatten(tree, [next(kept) if k is None else weights[k] for k in where])
        dh, dweights = vjp((dh, g_y))
        return dh, self.scatter(dweights)  # this layer's gradient reduce-scattered here

    def backward(self, g, leaves, kept, consts):
        """The last layer, then layers `L-2..1` in a reverse scan, each gathering the weights of
        the layer below, then layer 0. The forward's residual stacks are indexed, never sliced
        (a slice would copy every layer's activations)."""
        (dh, g_ys), (kept, kept_last), n = g, kept, leaves[0].shape[0]
        g_at = lambda i: jax.tree.map(lambda a: a[i], g_ys)  # noqa: E731
        weights = self.gather([w[-1] for w in leaves])
        below = self.gather([w[-2] for w in leaves]) if n > 1 else None
        dh, d_last = self.layer_grad(dh, g_at(n - 1), weights, kept_last, consts)
        if n == 1:
            return dh, [d[None] for d in d_last]

        def step(carry, xs):
            dh, weights = carry
            i, previous, g_y = xs
            previous = self.gather(previous)  # the layer below's weights, for the next step
            dh, dweights = self.layer_grad(dh, g_y, weights, [jax.lax.dynamic_index_in_dim(k, i, keepdims=False)
                                                              for k in kept], consts)
            return (dh, previous), dweights

        middle = (jnp.arange(1, n - 1), [w[: n - 2] for w in leaves], jax.tree.map(lambda a: a[1: n - 1], g_ys))
        (dh, bottom), d_mid = jax.lax.scan(step, (dh, below), middle, reverse=True, unroll=self.unroll)
        dh, d0 = self.layer_grad(dh, g_at(0), bottom, [k[0] for k in kept], consts)
        return dh, [jnp.concatenate([a[None], b, c[None]]) for a, b, c in zip(d0, d_mid, d_last, strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _prefetched(plan: _PrefetchPlan, x, leaves, *consts):
    return plan.forward(x, leaves, consts, keep=False)[0]


def _prefetched_fwd(plan, x, leaves, *consts):
    out, kept = plan.forward(x, leaves, consts, keep=True)
    return out, (leaves, kept, consts)


def _prefetched_bwd(plan, res, g):
    leaves, kept, consts = res
    dx, dleaves = plan.backward(g, leaves, kept, consts)
    return (dx, dleaves, *(None for _ in consts))


_prefetched.defvjp(_prefetched_fwd, _prefetched_bwd)


class PrefetchStack(ActivationHook):
    """The model's activation hook, also running its layer stack with prefetched weights.

    `eqgpt.nn.GPT` runs its layers through its hook's `run_stack` (`ActivationHook`'s is a
    scan). This one gathers layer `i+1`'s weights in the iteration of
    layer `i` and carries them, and in the backward pass layer `i-1`'s in the
    iteration of layer `i` (see module docs).

    **Fields:** `inner` (the hook it stands in for), `mesh`, and per array of one
    layer (in `jax.tree.leaves` order) its `sharded` and `gathered` specs.
    """

    inner: eqx.Module
    mesh: Mesh = eqx.field(static=True)
    sharded: tuple[PartitionSpec, ...] = eqx.field(static=True)
    gathered: tuple[PartitionSpec, ...] = eqx.field(static=True)

    def __call__(self, x: Array, names: tuple[str | None, ...]) -> Array:
        """The activation constraint of `inner`."""
        return self.inner(x, names)

    def run_stack(self, layer: Callable, x: PyTree, stacked: PyTree, *, unroll: int | bool = 1):
        """`jax.lax.scan(layer, x, stacked, unroll=unroll)` with prefetched weights (`layer(h, params)
        -> (h, ys)`). **Returns:** `(x, ys)` as the scan would."""
        leaves, tree = jax.tree.flatten(stacked)
        if len(leaves) != len(self.gathered):
            raise ValueError(f"PrefetchStack holds specs for {len(self.gathered)} arrays per layer, the stack "
                             f"has {len(leaves)}; install it with install_prefetch on the model it runs.")
        explicit, consts = _hoist(lambda h, weights: layer(h, tree.unflatten(weights)), x, [w[0] for w in leaves])
        return _prefetched(_PrefetchPlan(self, explicit, unroll), x, leaves, *consts)


def prefetch_axes(strategy: Strategy) -> tuple[str, ...]:
    """The mesh axes whose weight gathers `overlap` prefetches (`fsdp` where the rules use it)."""
    if strategy.mesh is None:
        return ()
    used = strategy.param_rules.uses("params", strategy.mesh)
    return tuple(a for a in WEIGHT_AXES if a in used and strategy.mesh.shape[a] > 1)


def install_prefetch(model: PyTree, strategy: Strategy) -> PyTree:
    """`model` whose `shard` hook is a `PrefetchStack` for `strategy` (unchanged when the
    strategy splits no weights over a `WEIGHT_AXES` axis, or the model is not a `GPT`, which runs
    its layer stack through that hook)."""
    axes = prefetch_axes(strategy)
    if not axes or not isinstance(model, GPT):
        return model
    specs = param_specs(model, strategy.param_rules, strategy.overrides, mesh=strategy.mesh).blocks
    arrays = jax.tree.leaves(eqx.filter(model.blocks, eqx.is_array))
    specs = [s for s in jax.tree.leaves(specs, is_leaf=is_spec) if is_spec(s)]
    layer = [PartitionSpec(*(tuple(s) + (None,) * (a.ndim - len(s)))[1:]) for s, a in zip(specs, arrays, strict=True)]
    return eqx.tree_at(lambda m: m.shard, model,
                       PrefetchStack(model.shard, strategy.mesh, tuple(layer), tuple(_without(s, axes) for s in layer)))


@dataclass(frozen=True)
class Overlap(Part):
    ("Overlap communication with compute: XLA's GPU scheduler flags (set before JAX starts) and FSDP weight "
     "prefetch; see docs/course/17-optimizing-communication.md.")

    name = "overlap"
    order = 70
    needs_mesh = False  # harmless on one device: nothing to overlap

    def before_backend(self) -> None:
        set_overlap_flags()

    def validate(self, strategy: Strategy) -> None:
        if not overlap_flags_set():
            platform = (strategy.mesh.devices.flat[0] if strategy.mesh is not None else jax.devices()[0]).platform
            if platform == "gpu":
                raise ValueError(
                    "overlap=True on GPU needs XLA's scheduler flags, which XLA reads when the backend starts: "
                    "call eqgpt.parallel.overlap.set_overlap_flags() before any JAX device use (the recipe's "
                    "--overlap does), or put them in XLA_FLAGS: " + " ".join(OVERLAP_FLAGS))
            _log.info("overlap: XLA's GPU scheduler flags are not set; on %s they would change nothing", platform)

    def loss_fn(self, strategy: Strategy, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        if not prefetch_axes(strategy):
            return loss  # no weights split over fsdp: the flags are all overlap does
        if not all(p.automatic and not p.runs_layers for p in strategy.parts):
            _log.info("overlap: the pipeline runs the layers itself; FSDP weights are not prefetched")
            return loss

        def prefetched(model, batch):
            return loss(install_prefetch(model, strategy), batch)

        return prefetched

    def describe(self, strategy: Strategy) -> str:
        return "overlap"


__all__ = ["OVERLAP_FLAGS", "Overlap", "PrefetchStack", "install_prefetch", "overlap_flags_set",
           "prefetch_axes", "set_overlap_flags"]
