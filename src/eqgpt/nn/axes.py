"""Logical axis names: the contract between modules and sharding rules.

Modules in `eqgpt.nn` know nothing about devices. They only say two things:

1. what each weight dimension *means*, through `param_axes()` on every module that
   owns arrays (read by `logical_axes(model)`), and
2. what each activation dimension means, by passing activations through their
   `shard` field: `self.shard(x, ("batch", "seq", "embed"))`.

The default `shard` is `NoConstraint`, which returns its input. `eqgpt.parallel`
swaps in constraints bound to a mesh and a rule set; nothing here changes.

Weight names: batch, seq, embed, heads, kv_heads, head_dim, mlp, vocab, layers, expert.
Activation names are the same, plus `inner_seq`: sequence positions inside an
attention or MLP region, kept separate from `seq` (the residual stream) so that
sequence parallelism can shard one and not the other.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

AxisNames = tuple[str | None, ...]

WEIGHT_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "expert")
ACTIVATION_AXES = WEIGHT_AXES + ("inner_seq",)
# The names a module's input goes through where a tensor-parallel region (attention, an
# MLP) starts: inside, the sequence is whole. Strategies act on this hook call.
REGION_INPUT: tuple[str, ...] = ("batch", "inner_seq", "embed")


class ActivationHook(eqx.Module):
    """What a module's `shard` field holds: called on each activation with its logical names,
    and asked by `GPT` to run the layer stack. Parallel parts subclass it (a sharding
    constraint, a tensor-parallel region, a prefetching stack)."""

    @abc.abstractmethod
    def __call__(self, x: Array, names: AxisNames) -> Array:
        """`x`, constrained as its logical `names` (one per dimension) say."""

    def run_stack(self, layer: Callable, x: PyTree, stacked: PyTree, *, unroll: int | bool = 1):
        """`layer(h, params) -> (h, ys)` over the stacked layers: `jax.lax.scan` (a hook may run
        it its own way: `eqgpt.parallel.overlap` prefetches each next layer's weights)."""
        return jax.lax.scan(layer, x, stacked, unroll=unroll)


class NoConstraint(ActivationHook):
    """The activation hook of an undistributed model: returns `x` unchanged."""

    def __call__(self, x: Array, names: AxisNames) -> Array:
        if x.ndim != len(names):
            raise ValueError(f"activation of shape {x.shape} given {len(names)} axis names {names}.")
        return x


class LogicalAxes:
    """Leaf holding the logical names of one array's dimensions."""

    __slots__ = ("names",)

    def __init__(self, names: AxisNames):
        self.names = tuple(names)

    def __repr__(self) -> str:
        return f"LogicalAxes{self.names}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalAxes) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)


def _has_param_axes(x: Any) -> bool:
    return isinstance(x, eqx.Module) and hasattr(x, "param_axes")


def logical_axes(model: PyTree) -> PyTree:
    """The model's structure with every array replaced by its `LogicalAxes`.

    Arrays with more dimensions than their module declares (layers stacked by
    `eqx.filter_vmap`) get `"layers"` prepended. Arrays outside any module with
    `param_axes` get all-`None` names (replicated).
    """

    def of_module(module: Any) -> Any:
        if not _has_param_axes(module):
            if eqx.is_array(module):
                return LogicalAxes((None,) * module.ndim)
            return module
        out = module
        for field, names in module.param_axes().items():
            arr = getattr(module, field)
            if arr is None:
                continue
            extra = arr.ndim - len(names)
            if extra < 0:
                raise ValueError(f"{type(module).__name__}.{field} has {arr.ndim} dims, fewer than {names}.")
            full = ("layers",) * extra + tuple(names)
            out = eqx.tree_at(lambda m, f=field: getattr(m, f), out, LogicalAxes(full))
        return out

    return jax.tree.map(of_module, model, is_leaf=lambda x: _has_param_axes(x))


def map_constraints(
    model: PyTree, fn: Callable[[tuple, Any], Any]
) -> PyTree:
    """Replace every activation hook (`shard` field) of `model` by `fn(path, hook)`.

    `path` is the JAX key path of the hook, e.g. `(.blocks, .attn, .shard)`, so a
    caller can give one module its own rules.
    """
    is_hook = lambda x: isinstance(x, ActivationHook)  # noqa: E731
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fn(p, x) if is_hook(x) else x, model, is_leaf=is_hook
    )


def varying_axes(x: Array) -> frozenset[str]:
    """The mesh axes over which `x` is varying (inside `shard_map`; empty outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # the attribute's name in JAX <= 0.9
    if vma is None:
        vma = aval.mat.varying  # JAX 0.10: "manual axis type"
    return frozenset(vma)
