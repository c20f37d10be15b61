"""Ring attention: queries stay, key/value shards travel around the `context` ring.

Runs *inside* `jax.shard_map` over the context axis, on the local shards:
`q: [b, T/n, h, d]`, `k, v: [b, T/n, g, d]` and their global positions (and
segment ids). With `n` devices on the axis:

```text
step s = 0 .. n-1:   device i holds the k/v shard of device (i - s) mod n
  partial_s = blockwise attention(q_i, kv_(i-s))     fp32 (out, lse)
  (out, lse) = merge(out, lse, partial_s)           online softmax
  send kv to device i+1, receive from i-1           (n-1 times in all)
```

The receive for step `s+1` is issued before the compute of step `s`, so the two
can overlap. Within a step the local queries are processed in `q_chunks` chunks
(so the blockwise kernel's temporaries are chunk-sized), and a chunk that no key
of the visiting shard can reach (`shard_may_attend`, from positions) is skipped
with `lax.cond`; inside a chunk, the blockwise kernel skips masked tiles the same
way. Every device joins every `ppermute` whichever branch it takes.

The backward pass (a `jax.custom_vjp`) keeps only `q, k, v`, the merged output and
its fp32 log-sum-exp, and runs the ring again: at each step
`blockwise_backward` gives this query shard's share of `dq` and of the visiting
shard's `dk, dv`, computed with the *global* output and LSE; `dk, dv` travel
(in fp32) with their `k, v`, and one last hop hands them to their owner.
Communication per device: forward `(n-1) * |k_i + v_i|`; backward the same for
`k, v`, plus `n * |dk_i + dv_i|` in fp32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.blockwise import (
    blockwise_backward,
    blockwise_forward,
    merge_partials,
    tie_to_activations,
)
from eqgpt.nn.mask import Mask
from eqgpt.parallel.collectives import ring_shift

# Finite stand-in for -inf, as in the blockwise kernel: the LSE of rows with no key.
_NEG = float(jnp.finfo(jnp.float32).min)


def shard_may_attend(
    mask: Mask, q_pos: Int[Array, " t"], k_pos: Int[Array, " s"], parts: int = 2
) -> Array:
    """Whether any query of the shard may attend any key of the other, from positions.

    Each shard is cut into `parts` contiguous pieces (a zigzag shard is two distant
    chunks, whose combined span would prove nothing) and `Mask.block_may_attend`
    is asked for every pair of pieces. Lengths `parts` does not divide use one piece.
    """
    pq = parts if q_pos.shape[0] % parts == 0 else 1
    pk = parts if k_pos.shape[0] % parts == 0 else 1
    pairs = jax.vmap(jax.vmap(mask.block_may_attend, (None, 0)), (0, None))
    return jnp.any(pairs(q_pos.reshape(pq, -1), k_pos.reshape(pk, -1)))


def _shift(tree, axis: str):
    """Send every leaf to the next device of the ring (i -> i+1 mod n): one `ppermute` each."""
    return jax.tree.map(lambda x: ring_shift(x, axis, shift=1), tree)


def _slicer(i, size):
    """Slice `size` rows starting at chunk `i` along an axis (None passes through)."""

    def sl(x, axis=1):
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)

    return sl


def _forward(mask, axis, scale, block_q, block_k, chunks, q, k, v, q_pos, k_pos, q_seg, k_seg):
    n = jax.lax.axis_size(axis)
    size = q.shape[1] // chunks
    kw = dict(mask=mask, scale=scale, block_q=block_q, block_k=block_k)

    def attend(acc, kv):
        """Merge the attention of every query chunk over the visiting shard `kv` into `acc`."""
        kj, vj, kp, ks = kv

        def chunk(i, acc):
            out, lse = acc
            sl = _slicer(i, size)
            qi, qp, qs, out_i, lse_i = sl(q), sl(q_pos, 0), sl(q_seg), sl(out), sl(lse)

            def compute(_):
                o, lse_s = blockwise_forward(qi, kj, vj, q_pos=qp, k_pos=kp, q_seg=qs, k_seg=ks, **kw)
                return merge_partials(out_i, lse_i, o.astype(jnp.float32), lse_s)

            out_i, lse_i = jax.lax.cond(
                shard_may_attend(mask, qp, kp), compute, lambda _: (out_i, lse_i), None
            )
            return (jax.lax.dynamic_update_slice_in_dim(out, out_i, i * size, 1),
                    jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * size, 1))

        return jax.lax.fori_loop(0, chunks, chunk, acc)

    def step(carry, _):
        acc, kv = carry
        incoming = _shift(kv, axis)  # independent of this step's compute: may overlap
        return (attend(acc, kv), incoming), None

    acc = (jnp.zeros_like(q, jnp.float32), jnp.full_like(q[..., 0], _NEG, jnp.float32))
    kv = (k, v, k_pos, k_seg)
    (acc, kv), _ = jax.lax.scan(step, (acc, kv), None, length=n - 1)
    out, lse = attend(acc, kv)
    return out.astype(q.dtype), lse


def _backward(mask, axis, scale, block_q, block_k, chunks, q, k, v, out, lse, dout,
              q_pos, k_pos, q_seg, k_seg):
    n = jax.lax.axis_size(axis)
    size = q.shape[1] // chunks
    kw = dict(mask=mask, scale=scale, block_q=block_q, block_k=block_k)

    def accumulate(grads, kv):
        """Add every query chunk's gradients against the visiting shard `kv` to `grads`."""
        kj, vj, kp, ks = kv

        def chunk(i, grads):
            dq, dk, dv = grads
            sl = _slicer(i, size)
            qi, qp, qs, dq_i = sl(q), sl(q_pos, 0), sl(q_seg), sl(dq)

            def compute(_):
                g_q, g_k, g_v = blockwise_backward(
                    qi, kj, vj, sl(out), sl(lse), sl(dout), q_pos=qp, k_pos=kp, q_seg=qs, k_seg=ks, **kw
                )
                f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
                return dq_i + f32(g_q), dk + f32(g_k), dv + f32(g_v)

            dq_i, dk, dv = jax.lax.cond(
                shard_may_attend(mask, qp, kp), compute, lambda _: (dq_i, dk, dv), None
            )
            return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * size, 1), dk, dv

        return jax.lax.fori_loop(0, chunks, chunk, grads)

    def step(carry, _):
        dq, kv, dkv = carry
        incoming = _shift(kv, axis)
        dq, *dkv = accumulate((dq, *dkv), kv)
        return (dq, incoming, _shift(tuple(dkv), axis)), None

    dq = jnp.zeros_like(q, jnp.float32)
    dkv = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    kv = (k, v, k_pos, k_seg)
    (dq, kv, dkv), _ = jax.lax.scan(step, (dq, kv, dkv), None, length=n - 1)
    dq, *dkv = accumulate((dq, *dkv), kv)
    # Device i now holds the gradients of the shard of device i+1: one last hop home.
    dk, dv = _shift(tuple(dkv), axis)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _ring(mask, axis, scale, block_q, block_k, chunks, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _forward(mask, axis, scale, block_q, block_k, chunks, q, k, v, q_pos, k_pos, q_seg, k_seg)[0]


def _ring_fwd(mask, axis, scale, block_q, block_k, chunks, q, k, v, q_pos, k_pos, q_seg, k_seg):
    out, lse = _forward(mask, axis, scale, block_q, block_k, chunks, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return out, (q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg)


def _ring_bwd(mask, axis, scale, block_q, block_k, chunks, res, dout):
    q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg = res
    dq, dk, dv = _backward(
        mask, axis, scale, block_q, block_k, chunks, q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg
    )
    return dq, dk, dv, None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check_chunks(length: int, chunks: int) -> None:
    if chunks < 1 or length % chunks:
        raise ValueError(
            f"q_chunks={chunks} must be a positive divisor of the local shard length {length}."
        )


def ring_attention(
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
    block_q: int = 128,
    block_k: int = 128,
    q_chunks: int = 1,
) -> Float[Array, "b t h d"]:
    """Exact attention of this device's queries over the keys of every device on `axis`.

    Call inside `jax.shard_map` over `axis`; every argument is this device's shard.

    **Arguments:**

    - `q`, `k`, `v`: local shards, `[batch, T/n, heads | kv_heads, head_dim]`.
    - `mask`: a `Mask` of `eqgpt.nn.mask`, applied to global positions.
    - `q_pos`, `k_pos`: global positions of the local queries and keys (any layout).
    - `q_seg`, `k_seg`: optional segment ids of the local tokens; documents may
      cross shard boundaries.
    - `scale`: score scale (default `head_dim ** -0.5`).
    - `axis`: the mesh axis of the ring.
    - `block_q`, `block_k`: tile sizes of the blockwise kernel run at each step.
    - `q_chunks`: the local queries are processed in this many chunks per ring step
      (must divide the shard length), so the blockwise kernel's temporaries are
      chunk-sized; chunks that the visiting shard cannot reach are skipped.

    **Returns:** the local shard of the attention output, typed like `q`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    _check_chunks(q.shape[1], q_chunks)
    q, k, v, q_pos, k_pos, q_seg, k_seg = tie_to_activations(q, k, v, q_pos, k_pos, q_seg, k_seg)
    return _ring(mask, axis, scale, block_q, block_k, q_chunks, q, k, v, q_pos, k_pos, q_seg, k_seg)


__all__ = ["ring_attention", "shard_may_attend"]
