"""Manual data parallelism, and `manual_grad_fn`: the whole manual path in one function.

Data parallelism by hand: every device of the data axes holds the whole model
(or its tensor-parallel slice) and its own rows of the batch. Inside
`shard_map`, the parameters are first marked *varying* over the data axes
(`to_varying`), so `jax.grad` returns each device's gradient of its own rows and
no communication is inserted for us; the gradients are then summed explicitly,
in fp32, by one `all_reduce` per array: `2 (n-1)/n` of the parameter bytes per
device and step (the analytic DP cost).

The loss is normalised by the *global* token count, so the per-device objective is
`sum(nll over my rows) / count(all rows)` and the summed gradient is exact also
with loss masks (a `pmean` of per-device means would weight devices equally
whatever their token counts).

`manual_grad_fn` composes this with manual tensor and sequence parallelism
(`eqgpt.parallel.tensor`, `eqgpt.parallel.sequence`) and plugs into the trainer's
`grad_fn(model, batch) -> ((loss, aux), grads)` contract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PyTree

from eqgpt.config import GPTConfig
from eqgpt.nn.axes import NoConstraint, map_constraints
from eqgpt.parallel.collectives import AxisName, all_reduce, to_varying
from eqgpt.parallel.placement import ShardedPlacement
from eqgpt.parallel.rules import strategy
from eqgpt.parallel.sequence import check_sequence_length
from eqgpt.parallel.shard_map import filter_shard_map, is_spec
from eqgpt.parallel.tensor import (
    kv_replicated,
    tensor_parallel,
    tensor_parallel_specs,
    vocab_parallel_loss_sums,
)


def reduce_gradients(
    grads: PyTree[Array], axes: AxisName | Sequence[AxisName], *, op: str = "sum"
) -> PyTree[Array]:
    """All-reduce gradients over data axes in fp32, whatever their dtype; cast back after.

    **Arguments:** `grads`; `axes`, one axis name (or tuple) for every array, or a
    list with one entry per array leaf of `grads` (in leaf order; `()` skips);
    `op`, `"sum"` or `"mean"`.

    **Returns:** the reduced gradients, invariant over the axes. **Bytes per
    device:** `2 (n-1)/n` of the fp32 gradient bytes.
    """
    leaves, treedef = jax.tree.flatten(grads)
    per_leaf = [axes] * len(leaves) if isinstance(axes, str | tuple) else list(axes)
    if len(per_leaf) != len(leaves):
        raise ValueError(f"reduce_gradients got {len(per_leaf)} axis entries for {len(leaves)} gradients.")
    out = [all_reduce(g.astype(jnp.float32), ax, op=op).astype(g.dtype) if ax else g
           for g, ax in zip(leaves, per_leaf, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _get(batch: Any, name: str, required: bool = True):
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    if value is None and required:
        raise ValueError(f"batch has no {name!r}; give a mapping with 'tokens' and 'targets' "
                         "(optional 'loss_mask', 'segment_ids').")
    return value


def _spec_axes(spec: PartitionSpec) -> set[str]:
    return {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}


class _Plan:
    """What `manual_grad_fn` and `manual_loss_fn` share: axes, specs, the local loss."""

    def __init__(self, model_like, mesh, tensor_axis, sequence_parallel, data_axes, chunk_size, z_loss,
                 compute_dtype):
        data_axes = tuple(data_axes)
        for a in (*data_axes, tensor_axis):
            if a not in mesh.shape:
                raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no {a!r}.")
        idle = [a for a in mesh.axis_names if a not in data_axes + (tensor_axis,) and mesh.shape[a] > 1]
        if idle:
            raise ValueError(
                f"the manual path runs data and tensor parallelism only; mesh axes {idle} have size > 1. "
                "Add them to data_axes or use the automatic path for them."
            )
        self.mesh, self.tensor_axis, self.sp = mesh, tensor_axis, sequence_parallel
        if isinstance(compute_dtype, str):
            names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
            compute_dtype = jnp.dtype(names.get(compute_dtype, compute_dtype))
        self.chunk_size, self.z_loss, self.compute_dtype = chunk_size, z_loss, compute_dtype
        self.dp = tuple(a for a in data_axes if mesh.shape[a] > 1)
        self.dp_size = 1
        for a in self.dp:
            self.dp_size *= mesh.shape[a]
        self.tp = mesh.shape[tensor_axis]
        if sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs a tensor axis of size > 1.")
        self.specs = tensor_parallel_specs(model_like, mesh, axis=tensor_axis)
        self.array_specs = eqx.filter(self.specs, is_spec, is_leaf=is_spec)
        self.batch_spec = PartitionSpec(self.dp or None, None)

        # Axes each array's gradient is summed over explicitly: the data axes, and under
        # SP the tensor axis for arrays every tensor device holds whole (they now see
        # different tokens on each device).
        def reduce_axes(spec):
            axes = self.dp
            if sequence_parallel and tensor_axis not in _spec_axes(spec):
                axes = axes + (tensor_axis,)
            return axes

        # One entry per array, in leaf order (spec trees are matched to models by leaf order).
        self.grad_axes = [reduce_axes(spec) for spec in jax.tree.leaves(self.specs, is_leaf=is_spec)]
        self._cache: dict = {}

    def check_batch(self, batch: Any) -> dict:
        if eqx.is_array(batch):  # the trainer's form: [batch, seq + 1] tokens
            if batch.ndim != 2 or batch.shape[1] < 2:
                raise ValueError(f"a token batch must be [batch, seq + 1]; got shape {batch.shape}.")
            batch = {"tokens": batch[:, :-1], "targets": batch[:, 1:]}
        names = ("tokens", "targets", "loss_mask", "segment_ids")
        b = {k: _get(batch, k, required=k in ("tokens", "targets")) for k in names}
        b = {k: v for k, v in b.items() if v is not None}
        rows, seq = b["tokens"].shape
        if rows % self.dp_size:
            raise ValueError(f"batch of {rows} rows does not split over data axes {self.dp} of size "
                             f"{self.dp_size}; use a batch size divisible by {self.dp_size}.")
        if self.sp:
            check_sequence_length(seq, self.tp)
        return b

    def local_loss(self, params, static, batch):
        """Per-device objective `sum(nll of my rows) / count(all rows)`, and (nll, z) sums."""
        tokens, targets = batch["tokens"], batch["targets"]
        loss_mask = batch.get("loss_mask")
        mask = jnp.ones(tokens.shape, jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
        count = jnp.maximum(all_reduce(jnp.sum(mask), self.dp) if self.dp else jnp.sum(mask), 1.0)
        if self.compute_dtype is not None:
            params = jax.tree.map(
                lambda p: p.astype(self.compute_dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params
            )
        # Inside shard_map every axis is manual: drop the automatic path's activation
        # constraints (a model placed by ShardedPlacement carries them).
        model = map_constraints(eqx.combine(params, static), lambda _path, _hook: NoConstraint())
        wrapped = tensor_parallel(model, size=self.tp, axis=self.tensor_axis, sequence_parallel=self.sp)
        nll, z, _ = vocab_parallel_loss_sums(
            wrapped, tokens, targets, loss_mask=loss_mask, segment_ids=batch.get("segment_ids"),
            chunk_size=self.chunk_size,
        )
        return (nll + self.z_loss * z) / count, (nll / count, z / count)

    def finish(self, loss, nll, z):
        if self.dp:
            loss, nll, z = all_reduce((loss, nll, z), self.dp)
        return loss, {"nll": nll, "z_loss": z}

    def local_grad(self, model, batch):
        params, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree.flatten(params)
        params = jax.tree.unflatten(treedef, [to_varying(p, ax) if ax else p
                                              for p, ax in zip(leaves, self.grad_axes, strict=True)])
        (loss, (nll, z)), grads = jax.value_and_grad(self.local_loss, has_aux=True)(params, static, batch)
        return self.finish(loss, nll, z), reduce_gradients(grads, self.grad_axes)

    def local_forward(self, model, batch):
        params, static = eqx.partition(model, eqx.is_array)
        loss, (nll, z) = self.local_loss(params, static, batch)
        return self.finish(loss, nll, z)

    def mapped(self, which: str, batch: dict) -> Callable:
        key = (which, frozenset(batch))
        if key not in self._cache:
            scalars = (PartitionSpec(), {"nll": PartitionSpec(), "z_loss": PartitionSpec()})
            out_specs = (scalars, self.array_specs) if which == "grad" else scalars
            fn = self.local_grad if which == "grad" else self.local_forward
            self._cache[key] = filter_shard_map(
                fn, mesh=self.mesh, in_specs=(self.specs, {k: self.batch_spec for k in batch}),
                out_specs=out_specs,
            )
        return self._cache[key]


def manual_grad_fn(
    model_like: PyTree,
    mesh: Mesh,
    *,
    tensor_axis: str = "tensor",
    sequence_parallel: bool = False,
    data_axes: Sequence[str] = ("data",),
    chunk_size: int = 128,
    z_loss: float = 0.0,
    compute_dtype: Any = None,
) -> Callable:
    """A `grad_fn(model, batch) -> ((loss, aux), grads)` running the manual DP x TP (x SP) path.

    The returned function takes the plain `GPT` (global arrays, any placement; the
    layout of `manual_specs` avoids a reshard) and a batch: the trainer's
    `[batch, seq + 1]` token array, or a mapping with `tokens`, `targets` and
    optionally `loss_mask`, `segment_ids` (`[batch, seq]`). Inside
    one `shard_map`: the model is wrapped by `tensor_parallel`, the loss is the
    vocabulary-parallel cross-entropy, and the gradients of arrays replicated over
    the data axes (and, under SP, over the tensor axis) are all-reduced explicitly
    in fp32.

    **Arguments:**

    - `model_like`: the model or `eqx.filter_eval_shape` of it (sizes only).
    - `mesh`: the mesh; axes other than `data_axes` and `tensor_axis` must have size 1.
    - `tensor_axis`: the tensor-parallel axis (size 1 turns TP off).
    - `sequence_parallel`: Megatron SP on the tensor axis.
    - `data_axes`: axes the batch rows are split over.
    - `chunk_size`, `z_loss`: as `eqgpt.nn.lm_loss`.
    - `compute_dtype`: cast floating parameters to this dtype for the forward
      (e.g. `jnp.bfloat16` or `"bf16"`); gradients come back in the parameter
      dtype and are reduced in fp32 regardless.

    **Returns:** the gradient function; `aux` has `nll` and `z_loss` like `lm_loss`.
    Raises `ValueError` for sizes the mesh cannot split.
    """
    plan = _Plan(model_like, mesh, tensor_axis, sequence_parallel, data_axes, chunk_size, z_loss, compute_dtype)

    def grad_fn(model: PyTree, batch: Any) -> tuple[tuple[Array, dict[str, Array]], PyTree]:
        """**Arguments:** the plain model and a batch. **Returns:** `((loss, aux), grads)`."""
        b = plan.check_batch(batch)
        return plan.mapped("grad", b)(model, b)

    return grad_fn


def manual_loss_fn(
    model_like: PyTree,
    mesh: Mesh,
    *,
    tensor_axis: str = "tensor",
    sequence_parallel: bool = False,
    data_axes: Sequence[str] = ("data",),
    chunk_size: int = 128,
    z_loss: float = 0.0,
    compute_dtype: Any = None,
) -> Callable:
    """The forward half of `manual_grad_fn`: `loss_fn(model, batch) -> (loss, aux)`.

    Same arguments as `manual_grad_fn`; useful to read the forward program's collectives.
    """
    plan = _Plan(model_like, mesh, tensor_axis, sequence_parallel, data_axes, chunk_size, z_loss, compute_dtype)

    def loss_fn(model: PyTree, batch: Any) -> tuple[Array, dict[str, Array]]:
        """**Arguments:** the plain model and a batch. **Returns:** `(loss, aux)`."""
        b = plan.check_batch(batch)
        return plan.mapped("forward", b)(model, b)

    return loss_fn


def manual_specs(model_like: PyTree, mesh: Mesh, *, tensor_axis: str = "tensor") -> PyTree:
    """Where `manual_grad_fn` expects the model's arrays (pass to `eqgpt.parallel.shard_map.place`)."""
    return tensor_parallel_specs(model_like, mesh, axis=tensor_axis)


def manual_placement(mesh: Mesh, config: GPTConfig) -> ShardedPlacement:
    """A trainer placement laying the model out as `manual_grad_fn` expects (`manual_specs`).

    The automatic path's `dp+tp` rules (batch rows over `data`; heads, kv heads,
    MLP width and vocabulary over `tensor`), with the kv projections replicated
    when there are fewer kv heads than tensor devices. Under SP too the batch is
    split by rows only: the manual step splits the sequence itself.

    **Arguments:** `mesh`, and the model's `config`.

    **Returns:** an `eqgpt.parallel.ShardedPlacement`.
    """
    rules = strategy("dp+tp")
    overrides = None
    if kv_replicated(config.kv_heads, mesh.shape["tensor"]):
        whole_kv = rules.update(params={"kv_heads": None})
        overrides = {"blocks.attn.k_proj": whole_kv, "blocks.attn.v_proj": whole_kv}
    return ShardedPlacement(mesh, rules, overrides)
