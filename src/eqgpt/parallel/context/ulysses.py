"""Ulysses attention: sequence-sharded to head-sharded and back, by all-to-alls over the context axis.

Runs inside `jax.shard_map` over the context axis, on the local shards
`q: [b, T/n, h, d]`, `k, v: [b, T/n, g, d]`. With `n` devices on the axis:

```text
q, k, v  [b, T/n, h, d]  --all-to-all (split heads, join sequence)-->  [b, T, h/n, d]
         the local kernel (the model's own, unmodified) on the whole sequence of h/n heads
out      [b, T, h/n, d]  --all-to-all (split sequence, join heads)-->  [b, T/n, h, d]
```

Positions and segment ids are all-gathered (integers, `4 T` bytes a row). The
built-in `reference` and `blockwise` kernels read positions, so they run on the
gathered sequence in layout order; any other kernel (`cudnn`, which takes the
sequence index for the position, or a user's) gets the sequence sorted into natural
order and its output sorted back (copies of `q, k, v` and the output, and their
gradients: memory, no communication).

Every device computes attention of *all* `T` queries over all `T` keys for its
`h/n` heads: the same work on every device whatever the mask, so Ulysses needs no
load balancing (zigzag changes nothing but the order of the rows it exchanges).

GQA: with `g` kv heads not divisible by `n`, each kv head is repeated
`r = n / gcd(g, n)` times before the exchange (`g r = lcm(g, n)` heads), so device
`j`'s query heads `[j h/n, (j+1) h/n)` find their kv heads on device `j`; this
needs `h % n == 0` only (then `h % lcm(g, n) == 0` too). The repeat's gradient sums
the copies.

Communication per device and layer: forward four all-to-alls, each `(n-1)/n` of
the local block (`q`, `k`, `v` in, the output back); for MHA `4 (n-1)/n` of the
layer's activations `[b, T/n, D]`. JAX differentiates each all-to-all into the
all-to-all with the dimensions swapped: the backward moves the same bytes again.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels import Kernel, get_kernel
from eqgpt.nn.kernels.blockwise import tie_to_activations
from eqgpt.nn.mask import Mask
from eqgpt.parallel.collectives import all_gather, all_to_all, axis_size


def kv_replication(num_heads: int, num_kv_heads: int, n: int) -> int:
    """How many copies of each kv head Ulysses exchanges over `n` devices.

    **Arguments:** query heads, kv heads, devices on the context axis.

    **Returns:** `r = n / gcd(num_kv_heads, n)` (1 when `n` divides the kv heads).

    **Raises:** `ValueError` naming `--context ulysses` when `n` does not divide the
    query heads (then no head split exists).
    """
    if num_heads % n:
        raise ValueError(
            f"--context ulysses splits the {num_heads} attention heads over the {n} devices of the "
            f"context axis, and {n} does not divide {num_heads}; use a context size that divides the "
            "heads, or --context ring / allgather."
        )
    return n // math.gcd(num_kv_heads, n)


def ulysses_bytes(*, rows: int, seq: int, num_heads: int, num_kv_heads: int, head_dim: int, n: int,
                  itemsize: int = 4) -> float:
    """Bytes one device sends in the four forward all-to-alls of one attention layer.

    **Arguments:** `rows` (batch rows on this device), `seq` (the whole sequence `T`),
    the heads, `head_dim`, `n` devices on the context axis, `itemsize` of the activations.

    **Returns:** `(n-1)/n * (|q_i| + |k_i| + |v_i| + |out_i|)` with `q_i, out_i` of
    `[rows, T/n, h, d]` and `k_i, v_i` of `[rows, T/n, g r, d]` (kv heads after
    replication, `kv_replication`). The backward sends the same again. For MHA it is
    `4 (n-1)/n` of the layer's activations `[rows, T/n, h d]`.
    """
    kv = num_kv_heads * kv_replication(num_heads, num_kv_heads, n)
    elements = rows * (seq // n) * head_dim * (2 * num_heads + 2 * kv)
    return (n - 1) / n * elements * itemsize


def _natural(x, order, dim: int = 1):
    return None if x is None else jnp.take(x, order, axis=dim)


def reads_positions(kernel: str | Kernel) -> bool:
    """Whether `kernel` masks by the positions it is given, in any order (the built-in
    `reference` and `blockwise`, by name, function or `functools.partial`)."""
    base = kernel.func if isinstance(kernel, functools.partial) else kernel
    return base in ("reference", "blockwise") or base in (get_kernel("reference"), get_kernel("blockwise"))


def ulysses_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t g d"],
    v: Float[Array, "b t g d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " t"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b t"] | None = None,
    scale: float | None = None,
    axis: str = "context",
    kernel: str | Kernel = "blockwise",
) -> Float[Array, "b t h d"]:
    """Exact attention of this device's sequence shard, computed head-sharded over `axis`.

    Call inside `jax.shard_map` over `axis`; every argument is this device's shard.

    **Arguments:** as `eqgpt.parallel.context.ring_attention`, and `kernel`: the
    attention kernel run on the whole sequence of this device's `h/n` heads (a
    registered name or a callable with the kernel signature).

    **Returns:** the local shard of the attention output, typed like `q`.
    """
    n = axis_size(axis)
    r = kv_replication(q.shape[2], k.shape[2], n)
    q, k, v, q_pos, k_pos, q_seg, k_seg = tie_to_activations(q, k, v, q_pos, k_pos, q_seg, k_seg)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    to_heads = lambda x: all_to_all(x, axis, split_dim=2, concat_dim=1)  # noqa: E731
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    gather = lambda x, dim: None if x is None else all_gather(x, axis, dim=dim)  # noqa: E731
    q_pos, k_pos, q_seg, k_seg = gather(q_pos, 0), gather(k_pos, 0), gather(q_seg, 1), gather(k_seg, 1)
    if reads_positions(kernel):
        out = get_kernel(kernel)(q, k, v, mask=mask, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg,
                                 scale=scale)
    else:  # the layout undone: natural order
        q_order, k_order = jnp.argsort(q_pos), jnp.argsort(k_pos)
        out = get_kernel(kernel)(
            _natural(q, q_order), _natural(k, k_order), _natural(v, k_order), mask=mask,
            q_pos=q_pos[q_order], k_pos=k_pos[k_order], q_seg=_natural(q_seg, q_order),
            k_seg=_natural(k_seg, k_order), scale=scale,
        )
        out = _natural(out, jnp.argsort(q_order))  # back into the layout
    return all_to_all(out, axis, split_dim=1, concat_dim=2)


__all__ = ["ulysses_attention", "ulysses_bytes", "kv_replication", "reads_positions"]
