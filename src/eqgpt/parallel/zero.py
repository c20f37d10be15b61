"""ZeRO-1 and ZeRO-2: the sharded weight update, a parameter server written in SPMD.

Xu et al. 2020 ("Automatic cross-replica sharding of weight update in
data-parallel training") and Rajbhandari et al. 2020 (ZeRO). Parameters stay
replicated over `data`, as in data parallelism; the optimizer state is split
over `data` (each device holds `1/n` of every moment), and each device updates
only its block of every parameter, then the updated blocks are all-gathered:

| stage | gradients | update | parameters |
|---|---|---|---|
| `zero=1` | all-reduced (as DP) | on this device's block | all-gathered |
| `zero=2` | reduce-scattered | on this device's block | all-gathered |

A reduce-scatter plus an all-gather move the same bytes as DP's all-reduce
(`2 (n-1)/n` of the parameter bytes per device); ZeRO-1 adds the all-gather on top.
In parameter-server terms (see `docs/parallelism/parameter-server.md`): device `i`
is the server of block `i` of every array; the reduce-scatter is the workers'
*push* of gradients, the all-gather their *pull* of new parameters.

Which block: every array is split along its first dimension (not yet split by the
strategy's own rules, e.g. `tensor`) whose size divides by `n`; an array with none
stays replicated and is updated whole on every device (norm scales of odd sizes).

Two forms, checked against data parallelism in `tests/test_zero.py`:

- **automatic** (`Strategy(..., parts=(Zero(1|2),))`): a placement that creates the optimizer
  state in the sharded layout, and `zero_update`, which pins the gradients (ZeRO-2),
  the new optimizer state and the freshly updated blocks to that layout and the new
  parameters back to replicated; the partitioner inserts the collectives.
- **manual** (`Zero(1|2)` with `Manual()`): `manual_zero_grad_fn` computes
  each device's gradient under `shard_map` and reduce-scatters (or all-reduces) it
  explicitly; `zero_update` then runs the optimizer under `shard_map` on the local
  blocks and `all_gather`s the new parameters.

Global-norm clipping inside the manual update must see the *global* norm, not the
block's: the manual update passes `block_norm` to the optimizer's update as its
`norm_fn` (an optax extra argument, read by `eqgpt.train.optim.clip_by_global_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, PyTree

from eqgpt.nn.axes import NoConstraint, map_constraints
from eqgpt.nn.loss import lm_batch_loss
from eqgpt.parallel.auto import _is_array_like, like_params, param_specs, put
from eqgpt.parallel.collectives import (
    all_gather,
    all_reduce,
    axis_index,
    reduce_scatter,
    to_varying,
)
from eqgpt.parallel.part import GradFn, Part, Update
from eqgpt.parallel.placement import ShardedPlacement
from eqgpt.parallel.rules import Rules, entry_axes, is_spec
from eqgpt.parallel.shard_map import filter_shard_map, reduced_grad, token_count
from eqgpt.precision import Policy, scale_value

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

ZERO_AXIS = "data"


def zero_dim(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, axis: str = ZERO_AXIS) -> int | None:
    """The dimension ZeRO splits an array of `shape` (laid out by `spec`) along, or `None`.

    The first dimension not split by `spec` whose size divides by `mesh.shape[axis]`;
    failing that, the first split one whose local size still divides. `None` when
    the array is already split over `axis` or nothing divides.
    """
    n = mesh.shape[axis]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if n == 1 or any(axis in entry_axes(e) for e in entries):
        return None
    for want_unsplit in (True, False):
        for d, (size, e) in enumerate(zip(shape, entries, strict=True)):
            split = math.prod(mesh.shape[a] for a in entry_axes(e))
            if (split == 1) == want_unsplit and size % (split * n) == 0:
                return d
    return None


def zero_spec(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh, axis: str = ZERO_AXIS) -> PartitionSpec:
    """`spec` with `axis` added on the `zero_dim` (unchanged if there is none)."""
    d = zero_dim(shape, spec, mesh, axis)
    if d is None:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    axes = entry_axes(entries[d]) + (axis,)
    entries[d] = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*entries)


def zero_specs(params: PyTree, mesh: Mesh, rules: Rules, overrides=None, axis: str = ZERO_AXIS) -> PyTree:
    """The optimizer-state layout of every parameter: its own spec plus `axis` on its `zero_dim`."""
    specs = param_specs(params, rules, overrides, mesh=mesh)
    return jax.tree.map(lambda s, x: zero_spec(tuple(x.shape), s, mesh, axis) if is_spec(s) else s,
                        specs, params, is_leaf=is_spec)


def _zero_dims(tree: PyTree, mesh: Mesh, axis: str) -> list[int | None]:
    """The `zero_dim` of every array of `tree` (replicated), in leaf order."""
    return [zero_dim(tuple(x.shape), PartitionSpec(), mesh, axis) for x in jax.tree.leaves(tree)]


def _shardings(mesh: Mesh, specs: PyTree) -> PyTree:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


class ZeroPlacement(ShardedPlacement):
    """`ShardedPlacement` whose optimizer state is split over `data` (ZeRO-1/2); parameters
    and batches are placed as the base rules say.

    **Arguments:** as `ShardedPlacement`.
    """

    def opt_state_shardings(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """Moments (and master weights) in `zero_specs`; step counts and scalars replicated."""
        params = eqx.filter(model, _is_array_like)
        per_param = _shardings(self.mesh, zero_specs(params, self.mesh, self.rules, self.overrides))
        return like_params(opt_state, params, per_param, NamedSharding(self.mesh, PartitionSpec()))

    def init_opt_state(self, optimizer: Any, model: PyTree) -> PyTree:
        """`optimizer.init` compiled with the ZeRO layout as output: moments created split."""
        params = eqx.filter(model, eqx.is_array)
        shardings = self.opt_state_shardings(jax.eval_shape(optimizer.init, params), model)
        return jax.jit(optimizer.init, out_shardings=shardings)(params)

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """An existing optimizer state moved to the ZeRO layout."""
        return put(opt_state, self.opt_state_shardings(opt_state, model))

    def __repr__(self) -> str:
        return f"ZeroPlacement(mesh={dict(self.mesh.shape)}, rules={self.rules.name!r})"


def check_zero(strategy: Strategy, zero: int) -> None:
    """Raise `ValueError` for a `Strategy` whose ZeRO stage `zero` cannot work, before anything compiles."""
    mesh = strategy.mesh
    if mesh.shape.get(ZERO_AXIS, 1) < 2:
        raise ValueError(f"zero={zero} splits the optimizer state over the mesh's data axis; add data=N "
                         "(N > 1) to --mesh.")
    if "fsdp" in strategy.rules.uses("params", mesh):
        raise ValueError(f"fsdp already splits parameters, gradients and optimizer state (ZeRO-3); drop "
                         f"--zero {zero} or fsdp from --strategy.")
    if _manual(strategy) and strategy.rules.uses("params", mesh):
        raise ValueError(f"the manual ZeRO path runs data parallelism only; combine --zero {zero} with "
                         f"{strategy.rules.name} on the automatic path (drop --manual).")


# ------------------------------------------------------------------ global norms of blocks

def block_norm(axis: str, sharded: list[bool]) -> Callable[[PyTree], Array]:
    """`norm(tree)`: the global L2 norm (fp32) of a tree whose leaves are this device's
    blocks (`sharded[i]`, squares summed over `axis`) or whole replicated arrays."""

    def norm(tree: PyTree) -> Array:
        squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
        if len(squares) != len(sharded):
            raise ValueError(f"block_norm: {len(squares)} arrays, but {len(sharded)} blocks were described.")
        split = sum((q for q, b in zip(squares, sharded, strict=True) if b), jnp.float32(0.0))
        whole = sum((q for q, b in zip(squares, sharded, strict=True) if not b), jnp.float32(0.0))
        return jnp.sqrt(all_reduce(split, axis) + whole)

    return norm


# ------------------------------------------------------------------ the update


def zero_update(update: Update, mesh: Mesh, *, stage: int, rules: Rules, overrides=None,
                manual: bool = False, axis: str = ZERO_AXIS) -> Update:
    """`update(grads, opt_state, params) -> (params, opt_state)` run as ZeRO `stage` (1 or 2).

    `update` is the plain optimizer update of `make_train_step`; it takes optax extra
    arguments as keywords. On the automatic
    path the gradients (ZeRO-2), the updated blocks and the new optimizer state are
    pinned to `zero_specs` and the new parameters to their own layout. On the
    manual path (`manual=True`; gradients from `manual_zero_grad_fn`, already
    reduce-scattered for ZeRO-2) `update` runs under `shard_map` on each device's
    blocks, with `norm_fn=block_norm(...)` for clipping, and the new blocks are `all_gather`ed.
    """
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}.")

    if not manual:
        def auto_update(grads, opt_state, params):
            full = _shardings(mesh, param_specs(params, rules, overrides, mesh=mesh))
            split = _shardings(mesh, zero_specs(params, mesh, rules, overrides, axis))
            pin = jax.lax.with_sharding_constraint
            # ZeRO-2: reduce-scatter instead of all-reduce, the push to the block's server.
            # ZeRO-1: whole summed gradients on every device (else the partitioner, seeing
            # only blocks used, would compile ZeRO-1 into ZeRO-2).
            grads = pin(grads, split if stage == 2 else full)
            new_params, new_opt = update(grads, opt_state, params)
            new_params = pin(pin(new_params, split), full)  # update the block, then the pull (all-gather)
            replicated = NamedSharding(mesh, PartitionSpec())
            return new_params, pin(new_opt, like_params(new_opt, params, split, replicated))

        return auto_update

    def manual_update(grads, opt_state, params):
        specs = zero_specs(params, mesh, rules, overrides, axis)
        dims = _zero_dims(params, mesh, axis)
        if any(entry_axes(e) for s in jax.tree.leaves(param_specs(params, rules, overrides, mesh=mesh),
                                                       is_leaf=is_spec) for e in s):
            raise ValueError("the manual ZeRO update supports data parallelism only (replicated parameters); "
                             "combine ZeRO with tp or the pipeline on the automatic path.")
        opt_specs = like_params(opt_state, params, specs, PartitionSpec())
        grad_specs = specs if stage == 2 else PartitionSpec()
        n = mesh.shape[axis]

        def block(x, d):
            if d is None:
                return x
            k = x.shape[d] // n
            return jax.lax.dynamic_slice_in_dim(x, axis_index(axis) * k, k, axis=d)

        def local(g, s, p):
            pl, pdef = jax.tree.flatten(p)
            gl = jax.tree.leaves(g)
            p_blocks = jax.tree.unflatten(pdef, [block(x, d) for x, d in zip(pl, dims, strict=True)])
            g_blocks = jax.tree.unflatten(pdef, gl if stage == 2 else
                                          [block(x, d) for x, d in zip(gl, dims, strict=True)])
            norm_fn = block_norm(axis, [d is not None for d in dims])
            new_blocks, new_s = update(g_blocks, s, p_blocks, norm_fn=norm_fn)
            new_p = [all_gather(x, axis, dim=d) if d is not None else x
                     for x, d in zip(jax.tree.leaves(new_blocks), dims, strict=True)]
            return jax.tree.unflatten(pdef, new_p), new_s

        mapped = filter_shard_map(local, mesh=mesh, in_specs=(grad_specs, opt_specs, PartitionSpec()),
                                  out_specs=(jax.tree.map(lambda _: PartitionSpec(), params), opt_specs),
                                  check_vma=False)
        return mapped(grads, opt_state, params)

    return manual_update


# ------------------------------------------------------------------ manual gradients


def manual_zero_grad_fn(mesh: Mesh, *, stage: int, policy: Any, chunk_size: int = 128, z_loss: float = 0.0,
                        axis: str = ZERO_AXIS) -> Callable:
    """`grad_fn(model, batch) -> ((loss, aux), grads)` of data parallelism under `shard_map`,
    with the gradient reduction of ZeRO `stage` written out.

    Each device differentiates `sum(loss of its rows) / tokens of all rows`; its
    gradients are then summed in fp32: ZeRO-1 `all_reduce`s them (every device gets
    the whole sum), ZeRO-2 `reduce_scatter`s every array along its `zero_dim` (device
    `i` gets block `i` of the sum: the gradients come out split over `data`, as
    `zero_update(manual=True)` takes them). Arrays with no `zero_dim` are all-reduced.
    """
    if stage not in (1, 2):
        raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}.")

    def reduce(grads):  # in fp32: ZeRO-2 reduce-scatters along each `zero_dim`, else all-reduce
        leaves, treedef = jax.tree.flatten(grads)
        dims = _zero_dims(leaves, mesh, axis)
        summed = [reduce_scatter(g.astype(jnp.float32), axis, dim=d) if stage == 2 and d is not None
                  else all_reduce(g.astype(jnp.float32), axis) for g, d in zip(leaves, dims, strict=True)]
        return jax.tree.unflatten(treedef, [s.astype(g.dtype) for s, g in zip(summed, leaves, strict=True)])

    def local(model, batch, scale):
        params, static = eqx.partition(model, eqx.is_array)
        shape = batch.tokens.shape
        weight = token_count(batch.loss_mask, shape) / token_count(batch.loss_mask, shape, axis)

        def loss_of(p):
            m = map_constraints(policy.compute_model(eqx.combine(p, static)), lambda _p, _h: NoConstraint())
            loss, aux = lm_batch_loss(m, batch, chunk_size=chunk_size, z_loss=z_loss)
            return loss.astype(jnp.float32) * weight, jax.tree.map(lambda a: a.astype(jnp.float32) * weight, aux)

        (loss, aux), grads = reduced_grad(loss_of, to_varying(params, axis), scale, reduce)
        return (all_reduce(loss, axis), all_reduce(aux, axis)), grads

    def grad_fn(model: PyTree, batch: Any, loss_scale=None):
        params = eqx.filter(model, eqx.is_array)
        dims = _zero_dims(params, mesh, axis)
        grad_specs = jax.tree.unflatten(jax.tree.structure(params), [
            PartitionSpec(*([None] * d + [axis])) if stage == 2 and d is not None else PartitionSpec()
            for d in dims])
        batch_spec = PartitionSpec(axis)
        mapped = filter_shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), batch_spec, PartitionSpec()),
                                  out_specs=((PartitionSpec(), {"nll": PartitionSpec(), "z_loss": PartitionSpec()}),
                                             grad_specs))
        return mapped(model, batch, scale_value(loss_scale))

    return grad_fn


# ------------------------------------------------------------------ the strategy part


def _manual(strategy: Strategy) -> bool:
    """Whether a part of `strategy` computes the gradients itself under `shard_map` (the manual path)."""
    return not all(p.automatic for p in strategy.parts)


@dataclass(frozen=True)
class Zero(Part):
    """ZeRO `stage` 1 or 2: the optimizer state split over `data`, parameters replicated.

    On the manual path the gradients come from `manual_zero_grad_fn` and the update runs
    under `shard_map`; otherwise the partitioner inserts the collectives.
    """

    stage: Literal[1, 2] = field(default=1, metadata={"cli": Literal[0, 1, 2]})
    ("ZeRO stage: 1 or 2 splits the optimizer state over the mesh's 'data' axis, parameters stay replicated (2 also "
     "reduce-scatters gradients); see docs/parallelism/parameter-server.md.")

    order = 40
    switch = "stage"

    def __post_init__(self):
        if self.stage not in (1, 2):
            raise ValueError(f"zero must be 0, 1 or 2 (ZeRO stage), got {self.stage!r}.")

    @property
    def name(self) -> str:
        return f"zero={self.stage}"

    def axes(self, strategy: Strategy) -> set[str]:
        return {ZERO_AXIS}

    def validate(self, strategy: Strategy) -> None:
        check_zero(strategy, self.stage)

    def placement(self, strategy: Strategy, model_like: PyTree) -> ZeroPlacement:
        return ZeroPlacement(strategy.mesh, strategy.param_rules, strategy.overrides)

    def grad_fn(self, strategy: Strategy, policy: Policy, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> GradFn | None:
        if not _manual(strategy):
            return None  # the strategy's own gradient; `zero_update` pins its layout
        return manual_zero_grad_fn(strategy.mesh, stage=self.stage, policy=policy, chunk_size=chunk_size,
                                   z_loss=z_loss)

    def update(self, strategy: Strategy, update: Update) -> Update:
        return zero_update(update, strategy.mesh, stage=self.stage, rules=strategy.param_rules,
                           overrides=strategy.overrides, manual=_manual(strategy))

    def describe(self, strategy: Strategy) -> str:
        return f"zero{self.stage}"


__all__ = ["Zero", "ZeroPlacement", "check_zero", "zero_dim", "zero_spec", "zero_specs", "zero_update",
           "manual_zero_grad_fn", "block_norm"]
