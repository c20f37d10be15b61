"""Pallas calls inside a `shard_map` that checks varying types (the pipeline, the manual path).

A Pallas call's output shapes carry no varying mesh axes, so with `check_vma=True` JAX
refuses it. `typed_call` runs the call in a nested `shard_map` over the axes still automatic with the check
off, and a custom VJP marks its outputs and gradients varying over every axis its inputs
vary over. The inputs are made varying over those axes first, outside the custom rule, so
autodiff still sums the gradient of an input that was invariant over one of them.
(Switching the check off in place does not survive a scan: it re-evaluates the custom
VJP's forward jaxpr with the check back on.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh

from eqgpt.nn.axes import varying_axes


def in_manual_region() -> bool:
    """Whether the caller traces inside a `shard_map` (some mesh axes manual)."""
    return bool(get_abstract_mesh().manual_axes)


def can_call_pallas() -> bool:
    """Whether `typed_call` can run here: it nests a `shard_map` over the axes still automatic,
    and newer JAX refuses one where every mesh axis is already manual."""
    mesh = get_abstract_mesh()
    return not mesh.manual_axes or len(mesh.manual_axes) < len(mesh.axis_names)


def _unchecked(f):
    """`f` in a nested `shard_map` over the axes still automatic, the check off. Its inputs are multiplied by one
    first: traced unchecked, the products carry no varying type, so every value agrees."""
    untyped = lambda x: x * jnp.ones((), x.dtype)  # noqa: E731
    body = lambda *args: f(*jax.tree.map(untyped, args))  # noqa: E731
    mesh = get_abstract_mesh()
    free = frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)
    return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=free, check_vma=False)


def _varying(x, axes: tuple[str, ...]):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _typed(f, axes, diff, aux):
    return jax.tree.map(lambda y: _varying(y, axes), _unchecked(f)(*diff, *aux))


def _typed_fwd(f, axes, diff, aux):
    out, back = _unchecked(lambda diff, aux: jax.vjp(lambda *d: f(*d, *aux), *diff))(diff, aux)
    return jax.tree.map(lambda y: _varying(y, axes), out), back


def _typed_bwd(f, axes, back, g):
    grads = _unchecked(lambda back, g: back(g))(back, g)
    return tuple(_varying(d, axes) for d in grads), None


_typed.defvjp(_typed_fwd, _typed_bwd)


def typed_call(f, diff: tuple, aux: tuple = ()):
    """`f(*diff, *aux)` inside a type-checked `shard_map`, differentiable in `diff` (float
    arrays), not in `aux` (integer arrays or `None`)."""
    if not can_call_pallas():
        raise ValueError("a Pallas kernel cannot run inside a shard_map over every mesh axis; leave one axis "
                         "automatic (axis_names=...), or use kernel 'blockwise' / 'ragged_dot' there.")
    axes = tuple(sorted(frozenset().union(*(varying_axes(x) for x in diff))))
    return _typed(f, axes, tuple(_varying(x, axes) for x in diff), aux)


__all__ = ["typed_call", "in_manual_region", "can_call_pallas"]
