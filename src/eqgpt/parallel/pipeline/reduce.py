"""What the pipeline step moves across the row axes (`data`, `fsdp`, `expert`) once per step.

Data parallelism: the batch is split over `data` and `fsdp`; every device
accumulates *local* gradients over all its microbatches and the step reduces them
once at the end: a `psum` over `data`, and a `psum_scatter` over `fsdp` along
the dimensions FSDP shards (FSDP parameters are all-gathered once per step
on entry). With `bucket_bytes` the end-of-step all-reduces (over `pipeline` for
the embedding and head, over the data axes for every array FSDP does not shard)
are packed into fp32 buckets (`eqgpt.parallel.buckets`): the same bytes in fewer
calls; FSDP's reduce-scatters stay one per array.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import PartitionSpec

from eqgpt.parallel.buckets import bucketed_all_reduce
from eqgpt.parallel.collectives import all_gather, all_reduce, reduce_scatter
from eqgpt.parallel.pipeline.stages import BATCH_AXES, ROW_AXES
from eqgpt.parallel.rules import entry_axes


@dataclass(frozen=True)
class BatchAxes:
    """Per dimension of a parameter, the manual row axes (`data`, `fsdp`, `expert`) splitting it.

    A pytree leaf (not a tuple), so trees of them map cleanly next to parameter trees.
    """

    dims: tuple[tuple[str, ...], ...]

    def spec(self, lead: tuple = ()) -> PartitionSpec:
        return PartitionSpec(*lead, *(None if not e else e[0] if len(e) == 1 else e for e in self.dims))


def batch_axes(spec: PartitionSpec, ndim: int, drop_lead: bool = False) -> BatchAxes:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    dims = tuple(tuple(a for a in entry_axes(e) if a in ROW_AXES) for e in entries)
    return BatchAxes(dims[1:] if drop_lead else dims)


def gather_params(tree, axes_tree, lead: int = 0):
    """All-gather every leaf over the data/fsdp axes its spec shards it over (once per step).

    `lead` leading dimensions (the stage's `[chunks, layers]`) come before those `axes_tree` describes.
    """

    def one(x, ba: BatchAxes):
        for dim, axes in enumerate(ba.dims):
            axes = tuple(a for a in axes if a in BATCH_AXES)  # experts stay split over `expert`
            if axes:
                x = all_gather(x, axes, dim=lead + dim)
        return x

    return jax.tree.map(one, tree, axes_tree)


def reduce_grads(tree, axes_tree, lead: int = 0, sum_axes: tuple[str, ...] = BATCH_AXES,
                  bucket_bytes: int | None = None):
    """Sum local gradients over all `sum_axes` devices, keeping FSDP's shards (once per step);
    the all-reduces packed into buckets of `bucket_bytes` (`None`: one per array)."""

    def scatter(g, ba: BatchAxes):
        used = set()
        for dim, axes in enumerate(ba.dims):
            used.update(axes)  # an expert's gradient lives on its device only
            axes = tuple(a for a in axes if a in BATCH_AXES)
            if axes:
                g = reduce_scatter(g, axes, dim=lead + dim)
        return g, tuple(a for a in sum_axes if a not in used)

    leaves, treedef = jax.tree.flatten(tree)
    done = [scatter(g, ba) for g, ba in zip(leaves, treedef.flatten_up_to(axes_tree), strict=True)]
    return sum_leaves(treedef, [g for g, _ in done], [ax for _, ax in done], bucket_bytes)


def sum_leaves(treedef, leaves, axes, bucket_bytes):
    """All-reduce `leaves` over their `axes` (in their dtype, bucketed in fp32 with `bucket_bytes`)."""
    if bucket_bytes is None:
        return jax.tree.unflatten(treedef, [all_reduce(g, ax) if ax else g for g, ax in zip(leaves, axes, strict=True)])
    return jax.tree.unflatten(treedef, bucketed_all_reduce(leaves, axes, bucket_bytes))


__all__ = ["BatchAxes", "batch_axes", "gather_params", "reduce_grads", "sum_leaves"]
