"""Gradient buckets: many small all-reduces packed into a few large ones.

A model has a gradient array per parameter, and data parallelism sums each over
the data axes. Written one per array, a step issues as many all-reduces as the
model has arrays (a GPT block has 16, norms and biases among them), and each pays
the collective's fixed latency, however few its bytes. Bucketing (PyTorch DDP's
`bucket_cap_mb`) flattens the arrays that reduce over the same axes, in order (inside
`shard_map`, those also varying over the same axes: a tensor-parallel shard and a
replicated norm scale are kept apart), into fp32 buffers of at most `bucket_bytes`, and
reduces each buffer with one all-reduce; the results are split back. The bytes on the
wire are unchanged (`2 (n-1)/n` of the fp32 gradient bytes); the count drops to the
number of buckets.

The trade-off: a bucket's all-reduce can start only when all its arrays'
gradients exist, so one huge bucket waits for the whole backward pass and hides
nothing, while tiny buckets pay the latency per call again. The count is what
`bucket_plan` returns: arrays are taken in order, and a bucket is closed when
the next array would take it over `bucket_bytes`; an array larger than a bucket
gets one of its own.

XLA also merges independent all-reduces after the fact (its all-reduce combiner,
on by default; on GPU `--xla_gpu_all_reduce_combine_threshold_bytes` caps a
merged one). Buckets written into the program fix the grouping whatever the
compiler's heuristics, and give each group one contiguous buffer.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import jax.numpy as jnp
from jaxtyping import Array

from eqgpt.parallel.collectives import AxisName, all_reduce, varying_axes

#: Bytes per MiB: `bucket_mb` and `--bucket-mb` are in MiB.
MB = 2**20


def bucket_bytes_of(bucket_mb: float | None) -> int | None:
    """`bucket_mb` (MiB, as the `--bucket-mb` flag) in bytes; `None` stays `None` (no buckets).

    Raises `ValueError` for a size <= 0 (or not finite).
    """
    if bucket_mb is None:
        return None
    if not 0 < bucket_mb < math.inf:
        raise ValueError(f"bucket_mb must be positive and finite (MiB per gradient bucket), got {bucket_mb}; "
                         "leave it unset for one all-reduce per array.")
    return max(1, int(bucket_mb * MB))


def bucket_plan(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Group arrays of `sizes` bytes, in order, into buckets of at most `bucket_bytes`.

    **Returns:** the buckets, each a list of indices into `sizes`; an array larger than
    `bucket_bytes` is a bucket of its own.
    """
    buckets: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if buckets and filled + size <= bucket_bytes:
            buckets[-1].append(i)
            filled += size
        else:
            buckets.append([i])
            filled = size
    return buckets


def bucketed_all_reduce(
    leaves: Sequence[Array], axes: Sequence[AxisName], bucket_bytes: int | None, *, op: str = "sum"
) -> list[Array]:
    """All-reduce each array over its `axes` in fp32, packed into buckets; cast back after.

    **Arguments:** `leaves`; `axes`, one entry per leaf (`()` skips it); `bucket_bytes`
    (`None`: one all-reduce per array); `op`, `"sum"` or `"mean"`.

    **Returns:** the reduced arrays, in order, invariant over their axes.

    **Bytes per device:** `2 (n-1)/n` of the fp32 bytes, bucketed or not.
    """
    out = list(leaves)
    # A bucket joins arrays of the same reduction axes and the same varying-ness (inside
    # `shard_map`): a tensor-parallel shard and a replicated norm scale stay apart, so
    # each result keeps its type (replicated stays replicated).
    keys = [(ax, varying_axes(leaf)) if ax else () for leaf, ax in zip(leaves, axes, strict=True)]
    for (ax, _), members in _groups(keys).items():
        if bucket_bytes is None:
            for i in members:
                out[i] = all_reduce(leaves[i].astype(jnp.float32), ax, op=op).astype(leaves[i].dtype)
            continue
        sizes = [4 * math.prod(leaves[i].shape) for i in members]
        for bucket in bucket_plan(sizes, bucket_bytes):
            idx = [members[b] for b in bucket]
            flat = jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1) for i in idx])
            summed = all_reduce(flat, ax, op=op)
            start = 0
            for i in idx:
                n = math.prod(leaves[i].shape)
                out[i] = summed[start:start + n].reshape(leaves[i].shape).astype(leaves[i].dtype)
                start += n
    return out


def all_reduce_count(sizes_by_axes: Sequence[tuple[Hashable, int]], bucket_bytes: int | None) -> int:
    """How many all-reduces `bucketed_all_reduce` issues for arrays of (grouping key, fp32 bytes).

    Without buckets, one per array that reduces over some axes. `axes` is the grouping
    key: under tensor parallelism pass `(axes, varying axes)` to count as the manual path groups.
    """
    groups = _groups([ax for ax, _ in sizes_by_axes]).values()
    if bucket_bytes is None:
        return sum(len(members) for members in groups)
    return sum(len(bucket_plan([sizes_by_axes[i][1] for i in members], bucket_bytes)) for members in groups)


def _groups(keys: Sequence) -> dict:
    """Indices of `keys` by key, in order; an empty key (nothing to reduce) joins no group."""
    groups: dict = {}
    for i, key in enumerate(keys):
        if key:
            groups.setdefault(key, []).append(i)
    return groups


__all__ = ["bucket_bytes_of", "bucket_plan", "bucketed_all_reduce", "all_reduce_count", "MB"]
