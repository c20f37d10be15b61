"""Run a per-device attention function under whatever mesh the caller traces in.

GSPMD cannot split a Pallas call, so a Pallas kernel runs per device: in a `shard_map`
over every mesh axis the partitioner still owns (rows over the batch axes, heads over
`tensor`). Inside a `shard_map` that checks varying types (the pipeline's stages, the
manual path) a Pallas call cannot say how its outputs vary; `eqgpt.nn.kernels.typed` runs it there.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh

from eqgpt.nn.kernels.typed import in_manual_region, typed_call

TENSOR = "tensor"  # the mesh axis heads split over; every other automatic axis takes batch rows


def _mesh_split(batch: int, heads: int, kv_heads: int):
    """The automatic mesh axes to split over (batch axes, heads axis), or `None` outside a mesh."""
    mesh = get_abstract_mesh()
    auto = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in mesh.manual_axes]
    if not auto:
        return None
    head_axis = TENSOR if TENSOR in auto and heads % mesh.shape[TENSOR] == 0 \
        and kv_heads % mesh.shape[TENSOR] == 0 else None
    rows, split = batch, []
    for a in auto:
        if a != head_axis and rows % mesh.shape[a] == 0:
            split.append(a)
            rows //= mesh.shape[a]
    # The shard_map takes every axis still automatic, size 1 too: a Mosaic call lowers only where
    # every mesh axis is manual.
    return mesh, tuple(split) or None, head_axis, frozenset(a for a in mesh.axis_names if a not in mesh.manual_axes)


def on_local_shards(local, q, k, v, q_seg, k_seg):
    """`local(q, k, v, q_seg, k_seg)` on each device's rows and heads of `[b, t, h, d]` arrays
    (segment ids `[b, t]` or `None`); the same call outside a mesh."""
    split = _mesh_split(q.shape[0], q.shape[2], k.shape[2])
    if split is None:
        if in_manual_region():
            return typed_call(local, (q, k, v), (q_seg, k_seg))
        return local(q, k, v, q_seg, k_seg)
    mesh, rows, heads, axes = split
    x, seg = P(rows, None, heads, None), P(rows, None)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(x, x, x, seg, seg), out_specs=x, axis_names=set(axes),
                           check_vma=False)
    return mapped(q, k, v, q_seg, k_seg)
