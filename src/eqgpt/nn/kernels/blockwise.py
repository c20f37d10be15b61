"""Blockwise (flash) attention in pure JAX: online softmax, linear memory.

Queries are cut into blocks of `block_q` rows and keys/values into blocks of
`block_k`; for each query block a scan over key blocks keeps an fp32 running max,
sum and accumulator, so the largest score array alive is
`[batch, heads, block_q, block_k]`. Blocks that the mask rules out from positions
alone (`Mask.block_may_attend`) are skipped with `jax.lax.cond`.

The gradient is a `jax.custom_vjp`: the forward pass keeps only the output and the
fp32 log-sum-exp of every query row, and the backward pass recomputes the scores
block by block (FlashAttention-2), never materialising a `[q_len, k_len]` array.

The two halves are public (`blockwise_forward`, `blockwise_backward`, plus
`merge_partials`) so that ring attention can run them once per ring step: the
backward of a query shard against several key/value shards, each given the
*globally merged* output and log-sum-exp, sums to the exact gradient.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.reference import group_queries
from eqgpt.nn.mask import Mask

# Finite stand-in for -inf: masked scores, and the log-sum-exp of rows with no key.
_NEG = float(jnp.finfo(jnp.float32).min)


# ----------------------------------------------------------------------------- helpers


def _check_blocks(block_q: int, block_k: int) -> None:
    if block_q < 1 or block_k < 1:
        raise ValueError(
            f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}."
        )


def _pad(x: Array, n: int, axis: int, mode: str) -> Array:
    """Pad `x` along `axis` to length `n` (zeros, or repeating the last entry)."""
    extra = n - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode=mode)


def _blocks(x: Array, block: int, axis: int, mode: str = "constant") -> Array:
    """Pad `axis` to a multiple of `block` and move the block index to the front."""
    length = x.shape[axis]
    num = -(-length // block)
    x = _pad(x, num * block, axis, mode)
    x = x.reshape(*x.shape[:axis], num, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _positions(pos: Array, seg: Array | None, length: int, block: int):
    """Blocked positions (edge-padded, so block min/max stay exact), validity, segments."""
    pos_b = _blocks(pos, block, 0, "edge")
    valid_b = _blocks(jnp.ones((length,), bool), block, 0)
    seg_b = None if seg is None else _blocks(seg, block, 1, "edge")
    return pos_b, valid_b, seg_b


def _allowed(mask: Mask, qp, kp, qs, ks, qv, kv) -> Array:
    """Mask of one (query block, key block) pair, shaped to broadcast on [b,g,r,q,k]."""
    allowed = mask(qp, kp, qs, ks) & (qv[:, None] & kv[None, :])
    return allowed[None, None, None] if allowed.ndim == 2 else allowed[:, None, None]


def _sizes(q, k, block_q, block_k):
    _check_blocks(block_q, block_k)
    t, s = q.shape[1], k.shape[1]
    return min(block_q, t), min(block_k, s)


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def _varying_zero(*xs) -> Array:
    """An fp32 scalar zero with the varying manual axes of `xs` (a plain 0 outside `shard_map`).

    Added to the scan carries so that, inside `jax.shard_map`, their initial values
    have the same type as the values the loop computes from the inputs.
    """
    return sum(jnp.zeros_like(x, jnp.float32, shape=()) for x in xs if x is not None)


def tie_to_activations(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """Make positions and segment ids depend on `q, k, v` (an `optimization_barrier`).

    Inside a differentiated `lax.scan` (the scanned layers of a GPT) JAX's partial
    evaluation hoists whatever depends only on loop constants out of the loop and
    keeps it as residuals. Positions are such constants, so every tile's mask (a
    function of positions alone) would be computed ahead and *stored*: quadratic
    memory. Tied to the activations, masks stay inside the kernel's loops.
    Every blockwise-style kernel (this one, ring and all-gather attention) calls it.
    """
    return jax.lax.optimization_barrier((q, k, v, q_pos, k_pos, q_seg, k_seg))


# ----------------------------------------------------------------------------- forward


def _forward(mask, scale, block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg):
    b, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = _sizes(q, k, block_q, block_k)
    qb = _blocks(group_queries(q, g), bq, 1)  # [nq, b, bq, g, r, d]
    kb, vb = _blocks(k, bk, 1), _blocks(v, bk, 1)  # [nk, b, bk, g, d]
    qpb, qvb, qsb = _positions(q_pos, q_seg, t, bq)
    kpb, kvb, ksb = _positions(k_pos, k_seg, s, bk)

    def one_query_block(xs):
        qi, qp, qv, qs = xs

        def step(carry, ys):
            kj, vj, kp, kv, ks = ys

            def compute(carry):
                m, denom, acc = carry
                scores = jnp.einsum(
                    "bqgrd,bkgd->bgrqk", qi, kj, preferred_element_type=jnp.float32
                )
                scores = scores.astype(jnp.float32) * scale
                allowed = _allowed(mask, qp, kp, qs, ks, qv, kv)
                scores = jnp.where(allowed, scores, _NEG)
                m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
                p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                denom = denom * corr + jnp.sum(p, axis=-1)
                pv = jnp.einsum(
                    "bgrqk,bkgd->bgrqd", p.astype(v.dtype), vj,
                    preferred_element_type=jnp.float32,
                )
                acc = acc * corr[..., None] + pv.astype(jnp.float32)
                return m_new, denom, acc

            carry = jax.lax.cond(
                mask.block_may_attend(qp, kp), compute, lambda c: c, carry
            )
            return carry, None

        zero = _varying_zero(q, k, v, q_pos, k_pos, q_seg, k_seg)
        init = (
            jnp.full((b, g, r, bq), _NEG, jnp.float32) + zero,
            jnp.zeros((b, g, r, bq), jnp.float32) + zero,
            jnp.zeros((b, g, r, bq, d), jnp.float32) + zero,
        )
        (m, denom, acc), _ = jax.lax.scan(step, init, (kb, vb, kpb, kvb, ksb))
        live = denom > 0
        safe_l = jnp.where(live, denom, 1.0)
        out = jnp.where(live[..., None], acc / safe_l[..., None], 0.0)
        lse = jnp.where(live, m + jnp.log(safe_l), _NEG)
        return out, lse

    out, lse = jax.lax.map(one_query_block, (qb, qpb, qvb, qsb))
    # out: [nq, b, g, r, bq, d] -> [b, t, h, d]; lse: [nq, b, g, r, bq] -> [b, t, h]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, -1, h, d)[:, :t]
    lse = jnp.transpose(lse, (1, 0, 4, 2, 3)).reshape(b, -1, h)[:, :t]
    return out.astype(q.dtype), lse


# ----------------------------------------------------------------------------- backward


def _tile_grads(mask, scale, qi, kj, vj, doi, lsei, deltai, qp, kp, qs, ks, qv, kv, operands):
    """The gradients of one (query block, key block) tile, added to `operands = (dk, dv, dq)`."""
    dk, dv, dqi = operands
    scores = jnp.einsum(
        "bqgrd,bkgd->bgrqk", qi, kj, preferred_element_type=jnp.float32
    )
    scores = scores.astype(jnp.float32) * scale
    allowed = _allowed(mask, qp, kp, qs, ks, qv, kv)
    p = jnp.where(allowed, jnp.exp(scores - lsei[..., None]), 0.0)
    dv = dv + jnp.einsum(
        "bgrqk,bqgrd->bkgd", p.astype(doi.dtype), doi,
        preferred_element_type=jnp.float32,
    )
    dp = jnp.einsum(
        "bqgrd,bkgd->bgrqk", doi, vj, preferred_element_type=jnp.float32
    )
    ds = p * (dp.astype(jnp.float32) - deltai[..., None]) * scale
    dqi = dqi + jnp.einsum(
        "bgrqk,bkgd->bqgrd", ds.astype(kj.dtype), kj,
        preferred_element_type=jnp.float32,
    )
    dk = dk + jnp.einsum(
        "bgrqk,bqgrd->bkgd", ds.astype(qi.dtype), qi,
        preferred_element_type=jnp.float32,
    )
    return dk, dv, dqi


def _backward(
    mask, scale, block_q, block_k, q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg
):
    b, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    r = h // g
    bq, bk = _sizes(q, k, block_q, block_k)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def rows(x):  # [b, t, h] -> [nq, b, g, r, bq]
        x = _blocks(x.reshape(b, t, g, r), bq, 1)  # [nq, b, bq, g, r]
        return jnp.transpose(x, (0, 1, 3, 4, 2))

    qb = _blocks(group_queries(q, g), bq, 1)  # [nq, b, bq, g, r, d]
    dob = _blocks(group_queries(dout, g), bq, 1)
    lseb, deltab = rows(lse.astype(jnp.float32)), rows(delta)
    kb, vb = _blocks(k, bk, 1), _blocks(v, bk, 1)  # [nk, b, bk, g, d]
    qpb, qvb, qsb = _positions(q_pos, q_seg, t, bq)
    kpb, kvb, ksb = _positions(k_pos, k_seg, s, bk)

    def one_key_block(dq, xs):
        kj, vj, kp, kv, ks = xs

        def step(carry, ys):
            qi, doi, lsei, deltai, qp, qv, qs, dqi = ys
            compute = partial(_tile_grads, mask, scale, qi, kj, vj, doi, lsei, deltai, qp, kp, qs, ks, qv, kv)
            dk, dv, dqi = jax.lax.cond(
                mask.block_may_attend(qp, kp), compute, lambda o: o, (*carry, dqi)
            )
            return (dk, dv), dqi

        init = (
            jnp.zeros((b, bk, g, d), jnp.float32) + zero,
            jnp.zeros((b, bk, g, d), jnp.float32) + zero,
        )
        (dk, dv), dq = jax.lax.scan(
            step, init, (qb, dob, lseb, deltab, qpb, qvb, qsb, dq)
        )
        return dq, (dk, dv)

    zero = _varying_zero(q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg)
    dq0 = jnp.zeros(qb.shape, jnp.float32) + zero
    dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, (kb, vb, kpb, kvb, ksb))
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, -1, h, d)[:, :t]
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, -1, g, d)[:, :s]
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, -1, g, d)[:, :s]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- custom vjp


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(mask, scale, block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg):
    out, _ = _forward(mask, scale, block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return out


def _attention_fwd(mask, scale, block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg):
    out, lse = _forward(mask, scale, block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return out, (q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg)


def _attention_bwd(mask, scale, block_q, block_k, res, dout):
    q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg = res
    dq, dk, dv = _backward(
        mask, scale, block_q, block_k, q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg
    )
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- public API


def blockwise_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b s"] | None = None,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> Float[Array, "b t h d"]:
    """Flash attention in pure JAX, with the same results as `reference_attention`.

    **Arguments:**

    - `q`: queries, `[batch, q_len, heads, head_dim]`.
    - `k`, `v`: keys and values, `[batch, k_len, kv_heads, head_dim]`; `heads` must
        be a multiple of `kv_heads` (MHA, GQA, MQA). Key/value heads are shared by
        their query group, never repeated in memory.
    - `mask`: a `Mask`; blocks it rules out from positions alone are skipped.
    - `q_pos`, `k_pos`: global integer positions of queries and keys (need not be
        contiguous).
    - `q_seg`, `k_seg`: optional segment (document) ids, `[batch, len]`.
    - `scale`: score scale; defaults to `head_dim ** -0.5`.
    - `block_q`, `block_k`: block sizes; clamped to the sequence lengths, which need
        not be multiples of them.

    **Returns:** the attention output, shaped and typed like `q`. Rows with no
    allowed key are zero. Differentiable w.r.t. `q`, `k`, `v` with a memory-linear
    backward pass.
    """
    _check_blocks(block_q, block_k)
    q, k, v, q_pos, k_pos, q_seg, k_seg = tie_to_activations(q, k, v, q_pos, k_pos, q_seg, k_seg)
    return _attention(
        mask, _scale(q, scale), block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg
    )


def blockwise_forward(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b s"] | None = None,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b t h"]]:
    """Forward half of blockwise attention: output and per-row log-sum-exp.

    **Arguments:** as `blockwise_attention`.

    **Returns:** `(out, lse)`: `out` shaped and typed like `q`, and `lse`, fp32
    `[batch, q_len, heads]`, the log-sum-exp of the scaled allowed scores of each
    query row. Rows with no allowed key have `out = 0` and a very negative finite
    `lse`, so that `merge_partials` gives them no weight.
    """
    _check_blocks(block_q, block_k)
    return _forward(
        mask, _scale(q, scale), block_q, block_k, q, k, v, q_pos, k_pos, q_seg, k_seg
    )


def blockwise_backward(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    out: Float[Array, "b t h d"],
    lse: Float[Array, "b t h"],
    dout: Float[Array, "b t h d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b s"] | None = None,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[Float[Array, "b t h d"], Float[Array, "b s g d"], Float[Array, "b s g d"]]:
    """Backward half of blockwise attention (FlashAttention-2), recomputing scores.

    **Arguments:**

    - `q`, `k`, `v` and the keywords: as `blockwise_attention`.
    - `out`, `lse`: the attention output and its fp32 log-sum-exp. They may be the
        *globally merged* values over several key/value shards: then this call gives
        the share of the gradient due to the keys in `k`/`v`, and summing `dq` over
        shards (with each shard's `dk`, `dv`) gives the exact gradient.
    - `dout`: the cotangent of `out`.

    **Returns:** `(dq, dk, dv)`, typed like `q`, `k`, `v`.
    """
    _check_blocks(block_q, block_k)
    return _backward(
        mask, _scale(q, scale), block_q, block_k,
        q, k, v, out, lse, dout, q_pos, k_pos, q_seg, k_seg,
    )


def merge_partials(
    out_a: Float[Array, "b t h d"],
    lse_a: Float[Array, "b t h"],
    out_b: Float[Array, "b t h d"],
    lse_b: Float[Array, "b t h"],
) -> tuple[Float[Array, "b t h d"], Float[Array, "b t h"]]:
    """Merge two partial attention results over disjoint key sets, in fp32.

    **Arguments:**

    - `out_a`, `lse_a`: output and log-sum-exp of attention over the first keys.
    - `out_b`, `lse_b`: the same over the other keys.

    **Returns:** `(out, lse)` of attention over both key sets; `out` has the promoted
    dtype of `out_a` and `out_b` (pass an fp32 accumulator to keep fp32), `lse` is
    fp32. Rows empty in both stay zero.
    """
    lse_a, lse_b = lse_a.astype(jnp.float32), lse_b.astype(jnp.float32)
    top = jnp.maximum(lse_a, lse_b)
    lse = top + jnp.log(jnp.exp(lse_a - top) + jnp.exp(lse_b - top))
    w_a, w_b = jnp.exp(lse_a - lse), jnp.exp(lse_b - lse)
    out = (
        w_a[..., None] * out_a.astype(jnp.float32)
        + w_b[..., None] * out_b.astype(jnp.float32)
    )
    return out.astype(jnp.result_type(out_a, out_b)), lse


__all__ = [
    "blockwise_attention",
    "blockwise_backward",
    "blockwise_forward",
    "merge_partials",
]
