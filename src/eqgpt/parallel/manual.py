"""The manual path: data x tensor (x sequence) parallelism in one `shard_map`.

Data parallelism by hand: every device of the data axes holds the whole model
(or its tensor-parallel slice) and its own rows of the batch. Inside
`shard_map`, the parameters are first marked *varying* over the data axes
(`to_varying`), so `jax.grad` returns each device's gradient of its own rows and
no communication is inserted for us; the gradients are then summed explicitly,
in fp32, by one `all_reduce` per array: `2 (n-1)/n` of the parameter bytes per
device and step (the analytic DP cost). With `bucket_bytes` those all-reduces
are packed into fp32 buckets (`eqgpt.parallel.buckets`): the same bytes, fewer calls.

The loss is normalised by the *global* token count, so the per-device objective is
`sum(nll over my rows) / count(all rows)` and the summed gradient is exact also
with loss masks (a `pmean` of per-device means would weight devices equally
whatever their token counts).

Tensor (and sequence) parallelism: inside the same `shard_map` the model's leaf
layers are swapped for their tensor-parallel forms (`eqgpt.parallel.tensor`),
transiently; the model passed in and the gradients returned have the plain
model's structure. With `collective_matmul` (SP only) each region's all-gather and
reduce-scatter run as rings interleaved with the matmuls
(`eqgpt.parallel.collective_matmul`). MoE layers run under data and tensor
parallelism (not SP): their router statistics are summed over the data axes
before the metrics are formed, and each device's share of the router losses is
normalised by the whole batch, like the cross-entropy. `manual_grad_fn` plugs into the trainer's
`grad_fn(model, batch) -> ((loss, aux), grads)` contract; the `Manual` part builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PyTree

from eqgpt.data.batch import Batch
from eqgpt.nn.loss import add_router_losses
from eqgpt.nn.moe import MOE_METRICS, MoEStats, moe_layers
from eqgpt.parallel.buckets import all_reduce_count, bucket_bytes_of, bucketed_all_reduce
from eqgpt.parallel.collectives import AxisName, all_reduce, to_varying
from eqgpt.parallel.part import GradFn, LossFn, Part
from eqgpt.parallel.placement import ShardedPlacement
from eqgpt.parallel.rules import Rules
from eqgpt.parallel.sequence import check_sequence_length
from eqgpt.parallel.shard_map import filter_shard_map, is_spec, reduced_grad, token_count
from eqgpt.parallel.tensor import (
    check_tensor_parallel,
    tensor_parallel,
    tensor_parallel_specs,
    vocab_parallel_loss_sums,
)
from eqgpt.precision import Policy, scale_value

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

TENSOR = "tensor"


def reduce_gradients(
    grads: PyTree[Array], axes: AxisName | Sequence[AxisName], *, op: str = "sum", bucket_bytes: int | None = None
) -> PyTree[Array]:
    """All-reduce gradients over data axes in fp32, whatever their dtype; cast back after.

    **Arguments:** `grads`; `axes`, one axis name (or tuple) for every array, or a
    list with one entry per array leaf of `grads` (in leaf order; `()` skips);
    `op`, `"sum"` or `"mean"`; `bucket_bytes`, pack the arrays that reduce over the
    same axes into buckets of at most this many fp32 bytes (`None`: one all-reduce each).

    **Returns:** the reduced gradients, invariant over the axes. **Bytes per
    device:** `2 (n-1)/n` of the fp32 gradient bytes.
    """
    leaves, treedef = jax.tree.flatten(grads)
    per_leaf = [axes] * len(leaves) if isinstance(axes, str | tuple) else list(axes)
    if len(per_leaf) != len(leaves):
        raise ValueError(f"reduce_gradients got {len(per_leaf)} axis entries for {len(leaves)} gradients.")
    return jax.tree.unflatten(treedef, bucketed_all_reduce(leaves, per_leaf, bucket_bytes, op=op))


def _spec_axes(spec: PartitionSpec) -> set[str]:
    return {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}


class _ManualPlan:
    """What `manual_grad_fn` and `manual_loss_fn` share: axes, specs, the per-device loss."""

    def __init__(self, model_like, mesh, sequence_parallel, data_axes, chunk_size, z_loss, policy,
                 collective_matmul=False, bucket_bytes=None):
        data_axes = tuple(data_axes)
        for a in (*data_axes, TENSOR):
            if a not in mesh.shape:
                raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no {a!r}.")
        idle = [a for a in mesh.axis_names if a not in data_axes + (TENSOR,) and mesh.shape[a] > 1]
        if idle:
            raise ValueError(
                f"the manual path runs data and tensor parallelism only; mesh axes {idle} have size > 1. "
                "Add them to data_axes or use the automatic path for them."
            )
        self.mesh, self.sp = mesh, sequence_parallel
        self.collective_matmul, self.bucket_bytes = collective_matmul, bucket_bytes
        self.chunk_size, self.z_loss = chunk_size, z_loss
        self.policy = Policy() if policy is None else policy
        self.dp = tuple(a for a in data_axes if mesh.shape[a] > 1)
        self.dp_size = 1
        for a in self.dp:
            self.dp_size *= mesh.shape[a]
        self.tp = mesh.shape[TENSOR]
        if sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs a tensor axis of size > 1.")
        if collective_matmul and not sequence_parallel:
            raise ValueError("collective_matmul needs sequence parallelism on a tensor axis of size > 1 "
                             "(--strategy dp+sp with --mesh tensor=N): it splits SP's all-gather and "
                             "reduce-scatter into ring steps.")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
        self.max_len = model_like.seq_len
        self.aux_keys = ("nll", "z_loss", *(MOE_METRICS if moe_layers(model_like) else ()))
        self.specs = tensor_parallel_specs(model_like, mesh)
        self.array_specs = eqx.filter(self.specs, is_spec, is_leaf=is_spec)
        self.batch_spec = PartitionSpec(self.dp or None, None)

        # Axes each array's gradient is summed over explicitly: the data axes, and under
        # SP the tensor axis for arrays every tensor device holds whole (they now see
        # different tokens on each device).
        def reduce_axes(spec):
            axes = self.dp
            if sequence_parallel and TENSOR not in _spec_axes(spec):
                axes = axes + (TENSOR,)
            return axes

        # One entry per array, in leaf order (spec trees are matched to models by leaf order).
        self.grad_axes = [reduce_axes(spec) for spec in jax.tree.leaves(self.specs, is_leaf=is_spec)]

    def all_reduce_counts(self, model_like) -> tuple[int, int]:
        """Gradient all-reduces per step (one per array; with `bucket_bytes`, one per bucket)."""
        is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
        arrays = jax.tree.leaves(eqx.filter(model_like, is_array))
        keyed = []
        for a, spec, ax in zip(arrays, jax.tree.leaves(self.specs, is_leaf=is_spec), self.grad_axes, strict=True):
            split = _spec_axes(spec)
            local = a.size // math.prod(self.mesh.shape[n] for n in split)
            keyed.append(((ax, TENSOR in split) if ax else (), 4 * local))  # as bucketed_all_reduce groups them
        return all_reduce_count(keyed, None), all_reduce_count(keyed, self.bucket_bytes)

    def check_batch(self, batch: Any) -> None:
        if not isinstance(batch, Batch):
            raise ValueError(f"the manual path takes an eqgpt.data.Batch, got {type(batch).__name__}; "
                             "Batch.from_windows splits [batch, seq + 1] token windows.")
        if batch.positions is not None:
            raise ValueError("Batch.positions (per-row positions of packed documents) are not supported by the "
                             "manual path yet; leave them None (positions 0..seq-1), or use one device, the "
                             "automatic path or context parallelism.")
        rows, seq = batch.shape
        if rows % self.dp_size:
            raise ValueError(f"batch of {rows} rows does not split over data axes {self.dp} of size "
                             f"{self.dp_size}; use a batch size divisible by {self.dp_size}.")
        if self.max_len is not None and seq > self.max_len:
            raise ValueError(f"sequence of {seq} tokens is longer than the model's seq_len ({self.max_len}); "
                             "shorten the batch or build the model with a larger seq_len.")
        if self.sp:
            check_sequence_length(seq, self.tp)

    def local_loss(self, params, static, batch: Batch):
        """Per-device objective `sum(nll of my rows) / count(all rows)`, and the (nll, z) means."""
        count = token_count(batch.loss_mask, batch.shape, self.dp)
        model = self.policy.compute_model(eqx.combine(params, static))
        # Leaf layers -> tensor-parallel forms, hooks -> region entries; only inside this trace.
        model = tensor_parallel(model, size=self.tp, axis=TENSOR, sequence_parallel=self.sp, seq_len=batch.shape[1],
                                collective_matmul=self.collective_matmul)
        nll, z, _, stats = vocab_parallel_loss_sums(
            model, batch.tokens, batch.targets, loss_mask=batch.loss_mask, segment_ids=batch.segment_ids,
            chunk_size=self.chunk_size, axis=TENSOR, sequence_parallel=self.sp,
        )
        router, metrics = self.router_terms(model, stats, batch.shape)
        return (nll + self.z_loss * z) / count + router, ({"nll": nll / count, "z_loss": z / count}, metrics)

    def router_terms(self, model, stats, shape: tuple[int, int]) -> tuple[Array, dict[str, Array]]:
        """This device's share of the MoE router losses, and the whole batch's router metrics.

        The losses are linear in the statistics' sums, so the shares of the devices' rows
        (each normalised by the rows and tokens of all devices) add up over the data axes
        to the whole batch's loss; the metrics (the load's shares and maximum are not
        linear) come from the statistics summed over the data axes first.
        """
        if stats is None:
            return jnp.float32(0), {}
        rows = shape[0] * self.dp_size
        share, _ = add_router_losses(model, jnp.float32(0), {}, stats, rows=rows, tokens=rows * shape[1])
        if self.dp:
            stats = MoEStats(*all_reduce(tuple(stats[:-1]), self.dp), stats.layers)  # layers: per device already
        _, metrics = add_router_losses(model, jnp.float32(0), {}, stats, rows=rows, tokens=rows * shape[1])
        return share, metrics

    def finish(self, loss, parts, metrics):
        """The step's loss and aux: this device's shares summed over the data axes."""
        nll, z = parts["nll"], parts["z_loss"]
        if self.dp:
            loss, nll, z = all_reduce((loss, nll, z), self.dp)
        return loss, {"nll": nll, "z_loss": z, **metrics}

    def local_grad(self, model, batch, scale):
        """Gradients of `loss * scale` (the dynamic loss scale, 1 without it), divided by `scale`."""
        params, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree.flatten(params)
        params = jax.tree.unflatten(treedef, [to_varying(p, ax) if ax else p
                                              for p, ax in zip(leaves, self.grad_axes, strict=True)])
        (loss, aux), grads = reduced_grad(lambda p: self.local_loss(p, static, batch), params, scale, self.reduce)
        return self.finish(loss, *aux), grads

    def reduce(self, grads):
        """The devices' gradients all-reduced (in fp32) over their data (and, under SP, tensor) axes."""
        return reduce_gradients(grads, self.grad_axes, bucket_bytes=self.bucket_bytes)

    def local_forward(self, model, batch):
        params, static = eqx.partition(model, eqx.is_array)
        loss, aux = self.local_loss(params, static, batch)
        return self.finish(loss, *aux)

    def mapped(self, grad: bool) -> Callable:
        scalars = (PartitionSpec(), dict.fromkeys(self.aux_keys, PartitionSpec()))  # whole on every device
        if not grad:
            return filter_shard_map(self.local_forward, mesh=self.mesh, in_specs=(self.specs, self.batch_spec),
                                    out_specs=scalars)
        return filter_shard_map(self.local_grad, mesh=self.mesh,
                                in_specs=(self.specs, self.batch_spec, PartitionSpec()),
                                out_specs=(scalars, self.array_specs))


def manual_grad_fn(
    model_like: PyTree,
    mesh: Mesh,
    *,
    sequence_parallel: bool = False,
    data_axes: Sequence[str] = ("data",),
    chunk_size: int = 128,
    z_loss: float = 0.0,
    policy: Policy | None = None,
    collective_matmul: bool = False,
    bucket_bytes: int | None = None,
) -> GradFn:
    """A `grad_fn(model, batch) -> ((loss, aux), grads)` running the manual DP x TP (x SP) path.

    The returned function takes the plain model (global arrays; `manual_placement`'s
    layout avoids a reshard) and an `eqgpt.data.Batch`. Inside one `shard_map`:
    the model's leaf layers are swapped by `tensor_parallel` (transiently), the
    loss is the vocabulary-parallel cross-entropy, and the gradients of arrays
    replicated over the data axes (and, under SP, over the tensor axis) are
    all-reduced explicitly in fp32.

    **Arguments:**

    - `model_like`: the model or `eqx.filter_eval_shape` of it (sizes only).
    - `mesh`: the mesh; axes other than `data_axes` and `tensor` must have size 1.
    - `sequence_parallel`: Megatron SP on the `tensor` axis.
    - `data_axes`: axes the batch rows are split over.
    - `chunk_size`, `z_loss`: as `eqgpt.nn.lm_loss`.
    - `policy`: the `eqgpt.precision.Policy`; parameters are cast to its compute
      dtype inside the differentiated function, so gradients come back in the
      parameter dtype (and are reduced in fp32 regardless).
    - `collective_matmul`: under SP, rings of permutes interleaved with the matmuls
      in place of each region's all-gather and reduce-scatter.
    - `bucket_bytes`: pack the gradient all-reduces into fp32 buckets of at most
      this many bytes (`eqgpt.parallel.buckets`); `None`, one per array.

    **Returns:** the gradient function; `aux` has `nll` and `z_loss` like `lm_loss`. Its
    attribute `all_reduce_counts` is `(before, after)`: the gradient all-reduces per step
    without buckets (one per array) and with `bucket_bytes`.
    Raises `ValueError` (before compiling) for sizes the mesh cannot split, and
    for batches that are not a `Batch`, carry per-row `positions`, or do not split.
    """
    plan = _ManualPlan(model_like, mesh, sequence_parallel, data_axes, chunk_size, z_loss, policy,
                 collective_matmul, bucket_bytes)
    mapped = plan.mapped(grad=True)
    before, after = plan.all_reduce_counts(model_like)

    def grad_fn(model: PyTree, batch: Any, loss_scale=None) -> tuple[tuple[Array, dict[str, Array]], PyTree]:
        """**Arguments:** the plain model, a `Batch` and optionally the dynamic loss scale.
        **Returns:** `((loss, aux), grads)`."""
        plan.check_batch(batch)
        return mapped(model, batch, scale_value(loss_scale))

    grad_fn.all_reduce_counts = (before, after)
    return grad_fn


def manual_loss_fn(
    model_like: PyTree,
    mesh: Mesh,
    *,
    sequence_parallel: bool = False,
    data_axes: Sequence[str] = ("data",),
    chunk_size: int = 128,
    z_loss: float = 0.0,
    policy: Policy | None = None,
    collective_matmul: bool = False,
) -> LossFn:
    """The forward half of `manual_grad_fn`: `loss_fn(model, batch) -> (loss, aux)`.

    Same arguments as `manual_grad_fn`; for validation, and to read the forward
    program's collectives.
    """
    plan = _ManualPlan(model_like, mesh, sequence_parallel, data_axes, chunk_size, z_loss, policy, collective_matmul)
    mapped = plan.mapped(grad=False)

    def loss_fn(model: PyTree, batch: Any) -> tuple[Array, dict[str, Array]]:
        """**Arguments:** the plain model and a `Batch`. **Returns:** `(loss, aux)`."""
        plan.check_batch(batch)
        return mapped(model, batch)

    return loss_fn


def manual_placement(mesh: Mesh, model_like: PyTree) -> ShardedPlacement:
    """A trainer placement laying the model out as `manual_grad_fn` expects.

    The automatic path's `dp+tp` rules: batch rows over `data`; heads, kv heads,
    MLP width and vocabulary over `tensor`, with the kv projections of every
    attention with fewer kv heads than tensor devices replicated (the rules split
    whole heads only). Under SP too the batch is split by rows only: the manual
    step splits the sequence itself.

    **Arguments:** `mesh`, and the model or its `eqx.filter_eval_shape` (checked:
    a `ValueError` names any module whose sizes do not split over `tensor`).

    **Returns:** an `eqgpt.parallel.ShardedPlacement`.
    """
    check_tensor_parallel(model_like, mesh.shape[TENSOR])
    return ShardedPlacement(mesh, "dp+tp")


@dataclass(frozen=True)
class Manual(Part):
    """Manual path: data, tensor and (with 'sp' in --strategy) sequence parallelism under shard_map.

    `Manual(collective_matmul=True, bucket_mb=4)` sets its options. It lays the model out itself
    (`manual_placement`), so the rules' divisibility is not checked; batches are split by rows over
    `data` only.
    """

    collective_matmul: bool = field(default=False, metadata={"flag": "collective_matmul"})
    ("With 'sp' in --strategy: each region's all-gather/reduce-scatter as a ring of permutes interleaved with the "
     "matmuls (docs/parallelism/sp.md).")
    bucket_mb: float | None = field(default=None, metadata={"flag": "bucket_mb"})
    ("Pack the gradient all-reduces of --manual and --pipeline into fp32 buckets of at most this many MiB "
     "(docs/parallelism/dp.md).")

    name = "manual"
    order = 50
    automatic = False
    needs_shapes = True  # `manual_placement` checks the model's sizes against `tensor`

    def __post_init__(self):
        if self.bucket_mb is not None:
            bucket_bytes_of(self.bucket_mb)  # > 0

    def axes(self, strategy: Strategy) -> set[str]:
        return {"data", TENSOR}

    def validate(self, strategy: Strategy) -> None:
        if not all(p.on_manual_path for p in strategy.parts):
            raise ValueError("the manual path runs data, tensor and sequence parallelism only; drop --manual "
                             "to combine pipeline or context parallelism (they run on the automatic path).")
        if "fsdp" in strategy.rules.uses("params", strategy.mesh):
            raise ValueError("the manual path has no FSDP; use --strategy dp+tp (or dp+sp) with --manual.")
        if self.collective_matmul:
            if strategy.mesh.shape.get(TENSOR, 1) < 2:
                raise ValueError("collective_matmul (--collective-matmul) splits the tensor axis's collectives into "
                                 "ring steps; the mesh has no tensor axis > 1: add one, e.g. --mesh data=2,tensor=4.")
            if not strategy.sequence_parallel:
                raise ValueError("collective_matmul (--collective-matmul) needs sequence parallelism: use 'sp' in "
                                 "--strategy (e.g. dp+sp); plain tp's all-reduce, decomposed, is SP's layout.")

    def placement(self, strategy: Strategy, model_like: PyTree) -> ShardedPlacement:
        return manual_placement(strategy.mesh, model_like)

    def batch_rules(self, strategy: Strategy) -> Rules:
        return Rules(activations={"batch": "data"}, name="manual-batch")

    def check(self, strategy: Strategy, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        if moe_layers(model_like) and strategy.sequence_parallel:
            raise ValueError("the manual path runs MoE layers with data and tensor parallelism, not sequence "
                             "parallelism (the router needs the whole sequence); use --strategy dp+tp, or drop "
                             "--manual.")
        tensor = strategy.mesh.shape[TENSOR]
        if self.collective_matmul and seq_len % tensor:
            raise ValueError(f"collective_matmul (--collective-matmul) splits the sequence into tensor={tensor} "
                             f"ring chunks; seq_len {seq_len} is not divisible by {tensor}: "
                             f"use a multiple of {tensor}.")
        check_tensor_parallel(model_like, tensor)
        if strategy.sequence_parallel and seq_len % tensor:
            raise ValueError(f"sequence parallelism splits the sequence over tensor={tensor}"
                             f" devices; use a seq_len divisible by it (got {seq_len}).")

    def loss_fn(self, strategy: Strategy, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        return manual_loss_fn(model_like, strategy.mesh, sequence_parallel=strategy.sequence_parallel,
                              chunk_size=chunk_size, z_loss=z_loss, collective_matmul=self.collective_matmul)

    def grad_fn(self, strategy: Strategy, policy: Policy, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> GradFn:
        return manual_grad_fn(model_like, strategy.mesh, sequence_parallel=strategy.sequence_parallel,
                              chunk_size=chunk_size, z_loss=z_loss, policy=policy,
                              collective_matmul=self.collective_matmul, bucket_bytes=bucket_bytes_of(self.bucket_mb))

    def notes(self, strategy: Strategy, model_like: PyTree, batch_shape: tuple[int, int]) -> list[str]:
        return [line] if (line := bucket_report(strategy, model_like)) is not None else []

    def describe(self, strategy: Strategy) -> str:
        extra = (["collective matmul"] if self.collective_matmul else []) + (
            [f"buckets {self.bucket_mb:g} MiB"] if self.bucket_mb is not None else [])
        return ", ".join(["manual", *extra])


def bucket_report(strategy: Strategy, model_like: PyTree) -> str | None:
    """One line for a run's log: the manual path's gradient all-reduces per step, without and
    with its buckets; `None` where the strategy has no manual path with buckets (a pipeline's
    count is in its compiled program: `eqgpt.profile.collectives`).

    **Arguments:** the `Strategy`, the model or its `jax.eval_shape`.
    """
    manual = strategy.part(Manual)
    if manual is None or manual.bucket_mb is None:
        return None
    before, after = manual_grad_fn(model_like, strategy.mesh, sequence_parallel=strategy.sequence_parallel,
                                   bucket_bytes=bucket_bytes_of(manual.bucket_mb)).all_reduce_counts
    return f"gradient all-reduces per step: {before} -> {after} (buckets of at most {manual.bucket_mb:g} MiB)"


__all__ = ["Manual", "bucket_report", "manual_grad_fn", "manual_loss_fn", "manual_placement", "reduce_gradients"]
