"""Collective matmul: sequence parallelism's all-gather and reduce-scatter split into ring steps.

Under sequence parallelism (`eqgpt.parallel.sequence`) each tensor-parallel region
starts with an all-gather of the sequence shards before its column-parallel
matmuls, and ends with a reduce-scatter after its row-parallel matmul. Either
waits for the whole collective before (or after) the whole matmul. Collective
matmul (Wang et al., 2023; Megatron's and torchtitan's "async TP") cuts both into
`n` steps around a ring of the `n` tensor devices, so the permute of one
sequence chunk can run while the matmul of another computes:

```text
all-gather -> matmul (column side), device i, chunk k = [b, T/n, D]:
  step 0:   y[chunk i]       = x_i @ W           send x_i to i+1
  step s:   y[chunk i-s]     = x_(i-s) @ W       send it on (s < n-1)
matmul -> reduce-scatter (row side), partial p = x @ W over this device's features:
  step 0:   acc = p[chunk i-1]                   send acc to i+1
  step s:   acc = recv + p[chunk i-s-1]          send acc on (s < n-1)
  after n-1 permutes: acc = sum over devices of chunk i
```

The sums are the same as those of the plain collectives, reordered (the
reduce-scatter adds the `n` partials in ring order), so results agree to fp32
rounding. Each ring makes `n-1` collective-permutes of one chunk, `|[b, T/n, D]|`
bytes each: `(n-1)/n * |[b, T, D]|` in all, the all-gather's (or the
reduce-scatter's) volume. The backward pass is the transpose, again a ring:
the column side's gradient leaves as a ring reduce-scatter, the row side's as a
ring all-gather; `jax.grad` derives both from the forward permutes.

Column side inside a model: the region's hook (`TensorRegionHook`) gathers the
sequence with `ring_all_gather` and returns the whole `[b, T, D]` activation
(the module's code reads its shape); the chunks the ring delivered are kept, for
this trace only, next to that array, and each `ColumnParallelLinear` fed it
multiplies the chunks one by one (`column_matmul`). q, k and v (or SwiGLU's
gate and up) thus share one ring, like they share one all-gather; the assembled
array is dead code unless something else reads it.

Collective matmul needs the residual stream split on `seq` (SP). Plain TP's
`f`/`g` all-reduce would have to end replicated over `tensor`, and a ring of
permutes delivers blocks; its all-reduce decomposed (reduce-scatter + all-gather)
*is* sequence parallelism's layout (Megatron's `--tp-comm-overlap` and
torchtitan's async TP require SP for the same reason).
"""

from __future__ import annotations

from collections import OrderedDict

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqgpt.nn.linear import matmul_2d
from eqgpt.parallel.collectives import AxisName, axis_index, axis_size, ring_shift

# Trace-time memo: id(assembled array) -> (the array, its ring chunks). Bounded; a hit also
# checks identity, so a recycled id never returns another trace's chunks.
_CHUNKS: OrderedDict[int, tuple[Array, tuple[Array, ...]]] = OrderedDict()
_MEMO_SIZE = 64


def _assemble(chunks: tuple[Array, ...], axis: AxisName, dim: int) -> Array:
    """Place ring chunks in sequence order: step `s` on device `i` holds chunk `(i - s) mod n`."""
    n = len(chunks)
    order = (axis_index(axis) - jnp.arange(n)) % n  # global chunk j sits at ring step (i - j) mod n
    stacked = jnp.take(jnp.stack(chunks, axis=dim), order, axis=dim)
    shape = (*stacked.shape[:dim], n * stacked.shape[dim + 1], *stacked.shape[dim + 2:])
    return stacked.reshape(shape)


def ring_all_gather(x: Float[Array, "..."], axis: AxisName, *, dim: int = 1) -> Float[Array, "..."]:
    """All-gather `x` along `dim` as `n-1` ring permutes; the chunks are kept for `column_matmul`.

    **Arguments:** `x`, this device's chunk; `axis`; `dim`, the (sequence) dimension.

    **Returns:** the gathered array (as `collectives.all_gather(x, axis, dim=dim)`).

    **Bytes per device:** `(n-1) * |x|`, in `n-1` permutes of `|x|`. **Gradient:** a ring
    reduce-scatter (the permutes transposed).
    """
    chunks = [x]
    for _ in range(axis_size(axis) - 1):
        chunks.append(ring_shift(chunks[-1], axis))
    chunks = tuple(chunks)
    full = _assemble(chunks, axis, dim)
    _CHUNKS[id(full)] = (full, chunks)
    while len(_CHUNKS) > _MEMO_SIZE:
        _CHUNKS.popitem(last=False)
    return full


def ring_chunks(x: Array) -> tuple[Array, ...] | None:
    """The ring chunks `x` was assembled from by `ring_all_gather` in this trace, or `None`."""
    hit = _CHUNKS.get(id(x))
    return hit[1] if hit is not None and hit[0] is x else None


def column_matmul(x: Float[Array, "*batch in"], w: Float[Array, "in out"], axis: AxisName, *,
                  dim: int) -> Float[Array, "*batch out"]:
    """`x @ w`, chunk by chunk when `x` came from `ring_all_gather` (else one matmul).

    Each chunk's matmul depends only on the permute that delivered it, so the
    scheduler can run chunk `s`'s matmul while chunk `s+1` travels.
    """
    chunks = ring_chunks(x)
    if chunks is None:
        return matmul_2d(x, w)
    return _assemble(tuple(matmul_2d(c, w) for c in chunks), axis, dim)


def all_gather_matmul(x: Float[Array, "*batch in"], w: Float[Array, "in out"], axis: AxisName, *,
                      dim: int = 1) -> Float[Array, "*batch_whole out"]:
    """`all_gather(x, dim) @ w` as a collective matmul: `n-1` permutes, `n` chunk matmuls.

    **Arguments:** `x`, this device's chunk along `dim`; `w`, this device's weight columns;
    `axis`; `dim`. **Returns:** the product for the whole `dim` (varying over `axis`).
    **Bytes per device:** `(n-1) * |x|`.
    """
    return column_matmul(ring_all_gather(x, axis, dim=dim), w, axis, dim=dim)


def matmul_reduce_scatter(x: Float[Array, "*batch in"], w: Float[Array, "in out"], axis: AxisName, *,
                          dim: int = 1) -> Float[Array, "*batch_shard out"]:
    """`reduce_scatter(x @ w, dim)` as a collective matmul: `n` chunk matmuls, `n-1` permutes.

    Device `i` computes its partial product chunk by chunk, in the order the
    accumulator passing through it needs them, and adds the accumulator it
    received; after `n-1` permutes it holds the sum of chunk `i` over all devices.

    **Arguments:** `x`, this device's input features (whole along `dim`, which the axis
    size must divide); `w`, its weight rows; `axis`; `dim`.

    **Returns:** chunk `i` of `sum over devices of x @ w` (varying over `axis`).

    **Bytes per device:** `(n-1)/n * |x @ w|`. **Gradient:** a ring all-gather of the
    output's cotangent, each chunk multiplied as it arrives.
    """
    n = axis_size(axis)
    if x.shape[dim] % n:
        raise ValueError(f"collective_matmul: dimension {dim} of {x.shape} ({x.shape[dim]}) does not split over "
                         f"tensor={n}; use a sequence length divisible by {n}.")
    size, i = x.shape[dim] // n, axis_index(axis)

    def partial(step: int) -> Array:
        chunk = jax.lax.dynamic_slice_in_dim(x, ((i - step - 1) % n) * size, size, axis=dim)
        return matmul_2d(chunk, w)

    acc = partial(0)
    for step in range(1, n):
        acc = ring_shift(acc, axis) + partial(step)
    return acc


__all__ = ["ring_all_gather", "ring_chunks", "column_matmul", "all_gather_matmul", "matmul_reduce_scatter"]
