"""`filter_shard_map`: `jax.shard_map` for functions of Equinox modules.

`jax.shard_map` maps over pytrees of arrays. An Equinox module mixes arrays with
other leaves (activation functions, mask objects, hooks), so here every argument
is split with `eqx.partition` into its arrays, which go through `shard_map`, and
the rest, which is closed over and recombined inside. Results are split the same
way. Specs are pytrees with a `PartitionSpec` at each array leaf (the shape
`eqgpt.parallel.param_specs` returns), or one `PartitionSpec` for a whole argument.

The edges of a manual training step under `shard_map` (the manual path's, manual
ZeRO's, the pipeline's), where each device sees its own tokens: its loss is
normalised by the *global* token count (`token_count` over the axes that split the
tokens), so the devices' shares add up to the whole batch's mean, also with loss
masks; `reduced_grad` runs the backward pass on `loss * scale` (the dynamic loss
scale, 1 without it), reduces the gradients by the caller's reduction (the manual
path's all-reduce, ZeRO-2's reduce-scatter) and divides them by the scale. The
pipeline runs its own backward (a vjp per tick, seeded with the scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, PyTree

from eqgpt.parallel.collectives import AxisName, all_reduce
from eqgpt.parallel.rules import is_spec
from eqgpt.precision import unscale


def array_specs(specs: PyTree) -> PyTree:
    """Keep the `PartitionSpec` leaves of `specs`, `None` elsewhere (the shape of `eqx.partition`)."""
    if is_spec(specs):
        return specs
    return eqx.filter(specs, is_spec, is_leaf=is_spec)


def _spec_leaves(specs: Any) -> Any:
    """A single `PartitionSpec` (a prefix for everything), or the list of a spec tree's specs."""
    if is_spec(specs):
        return specs
    return jax.tree.leaves(specs, is_leaf=is_spec)


def _match(spec_leaves: Any, n: int, what: str) -> Any:
    if is_spec(spec_leaves):
        return spec_leaves
    if len(spec_leaves) != n:
        raise ValueError(
            f"{what} has {len(spec_leaves)} PartitionSpecs for {n} arrays; give a spec tree with one "
            "PartitionSpec per array (e.g. from param_specs of the same model), or one PartitionSpec."
        )
    return list(spec_leaves)


def filter_shard_map(
    fn: Callable,
    *,
    mesh: Mesh,
    in_specs: tuple,
    out_specs: Any,
    check_vma: bool = True,
) -> Callable:
    """Run `fn(*args)` under `jax.shard_map`, where args and results may hold non-arrays.

    **Arguments:**

    - `fn`: the per-device function; it sees each array as its local block.
    - `mesh`: the device mesh.
    - `in_specs`: one entry per positional argument: a `PartitionSpec` for all its
      arrays, or a pytree shaped like the argument with a `PartitionSpec` at each
      array leaf (other leaves are ignored).
    - `out_specs`: the same for the result.
    - `check_vma`: keep JAX's varying/invariant checks on (needed for the gradients
      described in `eqgpt.parallel.collectives`).

    Spec trees are matched to arrays in leaf order, so a spec tree made from one
    instance of a model fits another whose non-array parts differ (e.g. one whose
    activation hooks were swapped by `eqgpt.parallel.place_model`).

    **Returns:** a function of the same arguments returning global arrays.
    """
    if not isinstance(in_specs, tuple):
        raise ValueError("in_specs must be a tuple with one spec (tree) per positional argument.")
    in_leaves = tuple(_spec_leaves(s) for s in in_specs)
    out_leaves = _spec_leaves(out_specs)

    def wrapped(*args):
        if len(args) != len(in_specs):
            raise ValueError(f"filter_shard_map got {len(args)} arguments but {len(in_specs)} in_specs.")
        dynamic, static = eqx.partition(args, eqx.is_array)
        flat = [jax.tree.flatten(d) for d in dynamic]
        specs = tuple(_match(s, len(leaves), f"in_specs[{i}]")
                      for i, (s, (leaves, _)) in enumerate(zip(in_leaves, flat, strict=True)))
        out_structure = []

        def inner(*leaves):
            dyn = tuple(jax.tree.unflatten(tdef, lv) for lv, (_, tdef) in zip(leaves, flat, strict=True))
            out = fn(*eqx.combine(dyn, static))
            out_dyn, out_static = eqx.partition(out, eqx.is_array)
            out_flat, out_def = jax.tree.flatten(out_dyn)
            _match(out_leaves, len(out_flat), "out_specs")
            out_structure.append((out_def, out_static))
            return out_flat

        mapped = jax.shard_map(
            inner, mesh=mesh, in_specs=specs,
            out_specs=out_leaves if is_spec(out_leaves) else list(out_leaves), check_vma=check_vma,
        )
        out_flat = mapped(*(leaves for leaves, _ in flat))
        out_def, out_static = out_structure[-1]
        return eqx.combine(jax.tree.unflatten(out_def, out_flat), out_static)

    return wrapped


def place(tree: PyTree, mesh: Mesh, specs: PyTree) -> PyTree:
    """Move the arrays of `tree` to `NamedSharding(mesh, spec)`; other leaves stay.

    **Arguments:** `tree`, `mesh`, and `specs` as in `filter_shard_map`.

    **Returns:** `tree` with its arrays placed.
    """
    dynamic, static = eqx.partition(tree, eqx.is_array)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), array_specs(specs), is_leaf=is_spec)
    return eqx.combine(jax.device_put(dynamic, shardings), static)


# ------------------------------------------------------------------ the edges of a manual step


def token_count(mask: Array | None, shape: tuple[int, ...], axes: AxisName = ()) -> Array:
    """The loss tokens of a block of `shape` (`mask`'s sum; all of them without a mask), summed
    over `axes` (none: this device's), and at least 1: the fp32 divisor of a loss."""
    local = jnp.float32(math.prod(shape)) if mask is None else jnp.sum(mask.astype(jnp.float32))
    return jnp.maximum(all_reduce(local, axes) if axes else local, 1.0)


def reduced_grad(
    loss_fn: Callable[[PyTree], tuple[Array, PyTree]], params: PyTree, scale: Array,
    reduce: Callable[[PyTree], PyTree],
) -> tuple[tuple[Array, PyTree], PyTree]:
    """`((loss, aux), grads)` of `loss_fn(params) -> (loss, aux)` on this device: the gradients
    of `loss * scale`, reduced over the devices by `reduce(grads)`, then divided by `scale`."""

    def scaled(p):
        loss, aux = loss_fn(p)
        return loss * scale, (loss, aux)  # the backward pass runs on the scaled loss

    (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return (loss, aux), unscale(reduce(grads), scale)
