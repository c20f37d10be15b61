"""Typed collectives for code running inside `jax.shard_map`.

Every function here works on the *local block* a device holds and names the mesh
axis (or tuple of axes) it communicates over. Each docstring states

- **what** it computes, in terms of the blocks `x_0 .. x_{n-1}` held by the `n`
  devices of the axis,
- **bytes** each device sends (= receives) for the textbook algorithm: a ring
  all-reduce moves `2 (n-1)/n` of the array, an all-gather or a reduce-scatter
  `(n-1)/n` of the full (gathered / unreduced) array,
- **gradient**: the collective JAX runs in the backward pass (its transpose).

Gradients follow JAX's *varying / invariant* types (`check_vma=True`, the
default of `jax.shard_map`): a value is *invariant* over an axis when every device
of that axis provably holds the same value (the result of a `psum`, or an input
with a replicated spec) and *varying* otherwise. Turning invariant into varying
(`jax.lax.pcast(..., to="varying")`, inserted implicitly when the two kinds meet)
costs nothing forward and is a `psum` backward; `psum` (varying -> invariant) is
its mirror image. These two are Megatron's `f` and `g` operators; see
`docs/parallelism/manual.md`.

Broadcast, scatter and gather have no CPU HLO of their own, so they are written
with masks around `psum`, `psum_scatter` and `all_gather`; that keeps them
correct for any root and differentiable, at the byte cost stated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PyTree

from eqgpt.nn.axes import varying_axes  # noqa: F401  (part of this module's API)

AxisName = str | tuple[str, ...]


def axis_size(axis: AxisName) -> int:
    """Number of devices along `axis` (a name or a tuple of names)."""
    names = axis if isinstance(axis, tuple) else (axis,)
    size = 1
    for name in names:
        size *= jax.lax.axis_size(name)
    return size


def axis_index(axis: AxisName) -> Int[Array, ""]:
    """This device's position along `axis` (tuples are linearised, first axis major)."""
    return jax.lax.axis_index(axis)


def _check_root(root: int, axis: AxisName) -> int:
    n = axis_size(axis)
    if not 0 <= root < n:
        raise ValueError(f"root {root} is outside axis {axis!r} of size {n}; choose 0 <= root < {n}.")
    return root


def _check_divisible(x: Array, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: dimension {dim} of the local block {x.shape} is {x.shape[dim]}, "
            f"not divisible by the axis size {n}; pad it or choose another dim."
        )


def _is_root(root: int, axis: AxisName) -> Array:
    return axis_index(axis) == root


# ---------------------------------------------------------------------------- reductions


def all_reduce(
    x: PyTree[Array], axis: AxisName, *, op: Literal["sum", "mean", "max", "min"] = "sum"
) -> PyTree[Array]:
    """Every device gets `op(x_0, ..., x_{n-1})`, elementwise (`psum` / `pmean` / ...).

    **Arguments:** `x`, an array or pytree of arrays; `axis`; `op` one of
    `"sum"`, `"mean"`, `"max"`, `"min"`.

    **Returns:** the reduction, *invariant* over `axis`.

    **Bytes per device:** `2 (n-1)/n * |x|` (ring: a reduce-scatter, then an
    all-gather).

    **Gradient:** the result is invariant, so its cotangent is one value shared by
    the devices; the transpose of `sum` hands it to each device unchanged (a
    `pcast` to varying, no communication); `mean` also divides by `n`. `max` and
    `min` have no gradient in JAX: use them on `jax.lax.stop_gradient` values,
    e.g. the stabilising maximum of a log-sum-exp.
    """
    if op == "sum":
        return jax.lax.psum(x, axis)
    if op == "mean":
        return jax.lax.pmean(x, axis)
    if op == "max":
        return jax.lax.pmax(x, axis)
    if op == "min":
        return jax.lax.pmin(x, axis)
    raise ValueError(f'all_reduce op must be "sum", "mean", "max" or "min", got {op!r}.')


def all_gather(x: Array, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> Array:
    """Every device gets all blocks, concatenated (`tiled`) or stacked along `dim`.

    **Arguments:** `x`, the local block; `axis`; `dim`, where the blocks go;
    `tiled=True` concatenates (`[n*k, ...]`), `False` stacks a new axis (`[n, k, ...]`).

    **Returns:** the gathered array, *varying* over `axis` (each device holds its own
    copy, and each copy may receive its own cotangent).

    **Bytes per device:** `(n-1)/n` of the gathered array, i.e. `(n-1) * |x|`.

    **Gradient:** a reduce-scatter: device `i` receives the sum over all devices of
    the cotangent's block `i`.
    """
    return jax.lax.all_gather(x, axis, axis=dim, tiled=tiled)


def reduce_scatter(x: Array, axis: AxisName, *, dim: int = 0, tiled: bool = True) -> Array:
    """Device `i` gets block `i` (along `dim`) of `x_0 + ... + x_{n-1}` (`psum_scatter`).

    **Arguments:** `x`, the local (unreduced) array, `dim` divisible by `n`; `axis`;
    `tiled=True` keeps `dim` (size `k/n`), `False` removes it (needs size `n`).

    **Returns:** this device's block of the sum, varying over `axis`.

    **Bytes per device:** `(n-1)/n * |x|`.

    **Gradient:** an all-gather of the cotangent blocks.
    """
    n = axis_size(axis)
    _check_divisible(x, dim, n, "reduce_scatter")
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=tiled)


# ----------------------------------------------------------------------- rooted patterns


def broadcast(x: Array, axis: AxisName, *, root: int = 0) -> Array:
    """Every device gets the root's block `x_root`.

    Written as `psum(where(index == root, x, 0))`: XLA's CPU backend has no
    collective-broadcast, and the masked sum is exact (adding zeros).

    **Arguments:** `x`, the local block (only the root's is read); `axis`; `root`.

    **Returns:** `x_root`, invariant over `axis`.

    **Bytes per device:** as written, an all-reduce, `2 (n-1)/n * |x|`; a dedicated
    broadcast (`jax.lax.pbroadcast`, GPU only) needs `|x|` received per device.

    **Gradient:** reduce to the root: the root receives the (shared) cotangent, the
    other devices zero. Seen from outside `shard_map`, the dense program
    `y = X[root]` has exactly that gradient.
    """
    root = _check_root(root, axis)
    return jax.lax.psum(jnp.where(_is_root(root, axis), x, jnp.zeros_like(x)), axis)


def scatter(x: Array, axis: AxisName, *, root: int = 0, dim: int = 0) -> Array:
    """Device `i` gets block `i` (along `dim`) of the root's array `x_root`.

    Written as `psum_scatter(where(index == root, x, 0))`.

    **Arguments:** `x`, an array of the full size on every device (only the root's
    is read), `dim` divisible by `n`; `axis`; `root`.

    **Returns:** this device's block, varying over `axis`.

    **Bytes per device:** `(n-1)/n * |x|` (a reduce-scatter); a dedicated scatter
    sends `(n-1)/n * |x|` from the root and `|x|/n` into each other device.

    **Gradient:** a gather to the root: the root receives all cotangent blocks
    concatenated, the other devices zero.
    """
    root = _check_root(root, axis)
    _check_divisible(x, dim, axis_size(axis), "scatter")
    masked = jnp.where(_is_root(root, axis), x, jnp.zeros_like(x))
    return jax.lax.psum_scatter(masked, axis, scatter_dimension=dim, tiled=True)


def gather(x: Array, axis: AxisName, *, root: int = 0, dim: int = 0) -> Array:
    """The root gets all blocks concatenated along `dim`; the other devices get zeros.

    Written as `where(index == root, all_gather(x), 0)`.

    **Arguments:** `x`, the local block; `axis`; `root`; `dim`.

    **Returns:** the concatenation on the root, zeros elsewhere; varying over `axis`.

    **Bytes per device:** as written, an all-gather, `(n-1) * |x|`; a dedicated
    gather receives `(n-1) * |x|` into the root and sends `|x|` from each other device.

    **Gradient:** a scatter from the root: device `i` receives block `i` of the
    root's cotangent (the other devices' cotangents meet zeros and vanish).
    """
    root = _check_root(root, axis)
    full = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
    return jnp.where(_is_root(root, axis), full, jnp.zeros_like(full))


# --------------------------------------------------------------------- point to point


def ppermute(x: Array, axis: AxisName, perm: Sequence[tuple[int, int]]) -> Array:
    """Send-receive: for each `(src, dst)` in `perm`, device `dst` gets `x_src`.

    Devices that are no `dst` get zeros. `perm` must not repeat a source or a
    destination.

    **Arguments:** `x`, the local block; `axis`; `perm`, pairs of axis indices.

    **Returns:** the received block, varying over `axis`.

    **Bytes per device:** `|x|` sent by each source, received by each destination.

    **Gradient:** `ppermute` of the cotangent with the inverse permutation
    (every pair reversed).
    """
    n = axis_size(axis)
    perm = [(int(s), int(d)) for s, d in perm]
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute pairs {perm} repeat a source or a destination; each may appear once.")
    if any(not 0 <= i < n for i in srcs + dsts):
        raise ValueError(f"ppermute pairs {perm} name devices outside axis {axis!r} of size {n}.")
    return jax.lax.ppermute(x, axis, perm)


def ring_shift(x: Array, axis: AxisName, *, shift: int = 1) -> Array:
    """Device `(i + shift) mod n` gets `x_i`: one step around a ring.

    **Arguments:** `x`, the local block; `axis`; `shift` (negative goes backwards).

    **Returns:** the block from device `(i - shift) mod n`, varying over `axis`.

    **Bytes per device:** `|x|` sent and `|x|` received.

    **Gradient:** a ring shift by `-shift`.
    """
    n = axis_size(axis)
    return jax.lax.ppermute(x, axis, [(i, (i + shift) % n) for i in range(n)])


def all_to_all(x: Array, axis: AxisName, *, split_dim: int, concat_dim: int) -> Array:
    """Device `j` gets block `j` (along `split_dim`) of every device, concatenated along `concat_dim`.

    With `split_dim=seq, concat_dim=heads` this turns a sequence-sharded array into
    a head-sharded one (DeepSpeed-Ulysses); swapping the two dims turns it back.

    **Arguments:** `x`, the local block, `split_dim` divisible by `n`; `axis`;
    `split_dim`, `concat_dim`.

    **Returns:** the exchanged block, varying over `axis`.

    **Bytes per device:** `(n-1)/n * |x|` (the block kept is not sent).

    **Gradient:** an all-to-all with `split_dim` and `concat_dim` swapped.
    """
    _check_divisible(x, split_dim, axis_size(axis), "all_to_all")
    return jax.lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)


# -------------------------------------------------------------------- type conversions


def to_varying(x: PyTree[Array], axis: AxisName) -> PyTree[Array]:
    """Mark `x` as varying over `axis`: no communication forward, a `psum` backward.

    Leaves already varying over `axis` are returned unchanged. This is Megatron's
    `f` operator (identity forward, all-reduce backward); inside `shard_map` JAX
    inserts it implicitly where an invariant value meets a varying one.
    """
    names = axis if isinstance(axis, tuple) else (axis,)

    def one(leaf):
        missing = tuple(a for a in names if a not in varying_axes(leaf))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(one, x)


