"""Causal flash attention for TPU in Pallas, on the model's own `[batch, seq, heads * head_dim]` layout.

Splash attention wants heads first (`[heads, seq, head_dim]`): the model transposes q, k, v
and the output around it, and at head_dim 64 each of its tiles fills half the TPU's 128
lanes. This kernel reads the layout the projections write. One tile of 128 lanes holds
`128 // head_dim` heads side by side; each head's scores come from a matmul with the other
heads' lanes zeroed, which costs the MXU what a 64-deep matmul costs it anyway, and the
results are written lane-dense. Blocks above the diagonal are never computed:
query block `i` loops over key blocks `0..i`, and only the diagonal block is masked.

The backward pass is one kernel per key block: dK and dV for that block, and dQ summed
across key blocks in VMEM. It needs the forward's log-sum-exp per row, stored
lane-major (`[batch, tiles, heads per tile, query blocks, block]`).

Covers causal self-attention with as many key/value heads as query heads, head_dim a
divisor of 128, up to `MAX_SEQ` positions and no segment ids (`supports`);
`flash_attention` hands every other case to splash (`eqgpt.nn.kernels.splash`), and
maps itself over the mesh as splash does. Interpret mode off TPU, so CPU tests run the
same kernel. Measured against splash on one TPU v5e in docs/measured/attention_flash.txt.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.mesh import on_local_shards
from eqgpt.nn.kernels.platform import interpret
from eqgpt.nn.kernels.splash import LANES, check_lengths, local_splash, splash_attention
from eqgpt.nn.mask import CausalMask, Mask

BLOCK = 512
"""Query and key block: 512 measured fastest at T=1024 to 4096, head_dim 64 (docs/measured/attention_flash.txt)."""
MAX_SEQ = 4096
"""The longest sequence it runs: the backward keeps a tile's q, dout and fp32 dq for the whole sequence in VMEM."""
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def supports(q_shape, k_shape) -> bool:
    """Whether this kernel runs causal attention of `q: [b, t, h, d]` over `k: [b, s, g, d]`."""
    _, t, h, d = q_shape
    _, s, g, _ = k_shape
    return (t == s and t % LANES == 0 and t <= MAX_SEQ and h == g and LANES % d == 0
            and (h * d) % min(LANES, h * d) == 0)


def _tile(width: int) -> int:
    """Lanes per tile: 128, or all of a narrower `heads * head_dim`."""
    return min(LANES, width)


def _head_lanes(head: int, d: int, tile: int):
    """A `[1, tile]` mask of the lanes of the tile's `head`."""
    return (jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1) // d) == head


def _row(col, n: int):
    """A `[n, 1]` column as a `[1, n]` row (through a lane-broadcast transpose, which the TPU does natively)."""
    return jnp.transpose(jnp.broadcast_to(col, (n, LANES)))[:1, :]


def _scaled(q, scale: float):
    """`q * scale`, rounded once to q's dtype."""
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def _forward_visit(j, carry, *, qh, k_ref, v_ref, block: int, causal=None):
    """Online softmax over key block `j` for one head's queries; `causal` masks the diagonal block."""
    m, denom, acc = carry
    rows = pl.ds(pl.multiple_of(j * block, block), block)
    s = jax.lax.dot_general(qh, k_ref[rows, :], NT, preferred_element_type=jnp.float32)
    if causal is not None:
        s = jnp.where(causal, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    pv = jnp.dot(p.astype(v_ref.dtype), v_ref[rows, :], preferred_element_type=jnp.float32)
    return m_new, alpha * denom + p.sum(axis=1, keepdims=True), alpha * acc + pv


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, d: int, block: int, scale: float):
    i = pl.program_id(2)
    tile = q_ref.shape[-1]
    q = _scaled(q_ref[...], scale)  # [block, tile]
    causal = (jax.lax.broadcasted_iota(jnp.int32, (block, block), 0)
              >= jax.lax.broadcasted_iota(jnp.int32, (block, block), 1))
    out = jnp.zeros((block, tile), jnp.float32)
    for head in range(tile // d):
        lanes = _head_lanes(head, d, tile)
        visit = functools.partial(_forward_visit, qh=jnp.where(lanes, q, 0), k_ref=k_ref, v_ref=v_ref, block=block)
        init = (jnp.full((block, 1), -jnp.inf, jnp.float32), jnp.zeros((block, 1), jnp.float32),
                jnp.zeros((block, tile), jnp.float32))
        m, denom, acc = visit(i, jax.lax.fori_loop(0, i, visit, init), causal=causal)
        out = jnp.where(lanes, acc / denom, out)
        lse_ref[head, pl.ds(i, 1), :] = _row(m + jnp.log(denom), block)
    o_ref[...] = out.astype(o_ref.dtype)


def _backward_visit(i, carry, *, head: int, lanes, kh, vh, refs, block: int, scale: float, causal=None):
    """Query block `i`'s part of one head's dK and dV (returned) and of its dQ (summed into VMEM)."""
    q_ref, do_ref, lse_ref, delta_ref, dq_acc = refs
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * block, block), block)
    qh = jnp.where(lanes, _scaled(q_ref[rows, :], scale), 0)
    doh = jnp.where(lanes, do_ref[rows, :], 0)
    st = jax.lax.dot_general(kh, qh, NT, preferred_element_type=jnp.float32)  # [keys, queries]
    pt = jnp.exp(st - lse_ref[head, pl.ds(i, 1), :])
    if causal is not None:
        pt = jnp.where(causal, pt, 0.0)
    dv = dv + jnp.dot(pt.astype(doh.dtype), doh, preferred_element_type=jnp.float32)
    dpt = jax.lax.dot_general(vh, doh, NT, preferred_element_type=jnp.float32)
    dst = (pt * (dpt - delta_ref[head, pl.ds(i, 1), :])).astype(qh.dtype)
    dk = dk + jnp.dot(dst, qh, preferred_element_type=jnp.float32)
    dq_acc[rows, :] += jax.lax.dot_general(dst, kh, TN, preferred_element_type=jnp.float32)
    return dk, dv


def _backward_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, dq_acc,
                     *, d: int, block: int, scale: float):
    j, blocks = pl.program_id(2), pl.num_programs(2)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    k, v = k_ref[...], v_ref[...]  # this key block: [block, tile]
    tile = k.shape[-1]
    causal = (jax.lax.broadcasted_iota(jnp.int32, (block, block), 0)  # [keys, queries]
              <= jax.lax.broadcasted_iota(jnp.int32, (block, block), 1))
    carry = (jnp.zeros((block, tile), jnp.float32), jnp.zeros((block, tile), jnp.float32))
    for head in range(tile // d):
        lanes = _head_lanes(head, d, tile)
        visit = functools.partial(_backward_visit, head=head, lanes=lanes, kh=jnp.where(lanes, k, 0),
                                  vh=jnp.where(lanes, v, 0), refs=(q_ref, do_ref, lse_ref, delta_ref, dq_acc),
                                  block=block, scale=scale)
        carry = jax.lax.fori_loop(j + 1, blocks, visit, visit(j, carry, causal=causal))
    dk_ref[...] = carry[0].astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)

    @pl.when(j == blocks - 1)
    def _():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _forward(q, k, v, d, block, scale, interpret):
    """`q, k, v: [b, t, h * d]` -> (out like q, lse `[b, tiles, heads per tile, t // block, block]` fp32)."""
    b, t, width = q.shape
    lanes = _tile(width)
    tiles, per = width // lanes, lanes // d
    tile = lambda bi, hi, i: (bi, i, hi)  # noqa: E731
    whole = lambda bi, hi, i: (bi, 0, hi)  # noqa: E731
    kernel = functools.partial(_forward_kernel, d=d, block=block, scale=scale)
    return pl.pallas_call(
        kernel,
        grid=(b, tiles, t // block),
        in_specs=[pl.BlockSpec((None, block, lanes), tile), pl.BlockSpec((None, t, lanes), whole),
                  pl.BlockSpec((None, t, lanes), whole)],
        out_specs=[pl.BlockSpec((None, block, lanes), tile),
                   pl.BlockSpec((None, None, per, t // block, block), lambda bi, hi, i: (bi, hi, 0, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, tiles, per, t // block, block), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="flash_forward",
    )(q, k, v)


def _backward(q, k, v, out, lse, dout, d, block, scale, interpret):
    b, t, width = q.shape
    lanes = _tile(width)
    tiles, per = width // lanes, lanes // d
    # delta_i = sum over the head's lanes of dout * out, lane-major like lse.
    delta = jnp.einsum("btnpd,btnpd->bnpt", *(x.reshape(b, t, tiles, per, d).astype(jnp.float32) for x in (dout, out)))
    delta = delta.reshape(b, tiles, per, t // block, block)
    tile = lambda bi, hi, j: (bi, j, hi)  # noqa: E731
    whole = lambda bi, hi, j: (bi, 0, hi)  # noqa: E731
    stats = pl.BlockSpec((None, None, per, t // block, block), lambda bi, hi, j: (bi, hi, 0, 0, 0))
    kernel = functools.partial(_backward_kernel, d=d, block=block, scale=scale)
    return pl.pallas_call(
        kernel,
        grid=(b, tiles, t // block),
        in_specs=[pl.BlockSpec((None, t, lanes), whole), pl.BlockSpec((None, block, lanes), tile),
                  pl.BlockSpec((None, block, lanes), tile), pl.BlockSpec((None, t, lanes), whole), stats, stats],
        out_specs=[pl.BlockSpec((None, t, lanes), whole), pl.BlockSpec((None, block, lanes), tile),
                   pl.BlockSpec((None, block, lanes), tile)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)],
        scratch_shapes=[pltpu.VMEM((t, lanes), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="flash_backward",
    )(q, k, v, dout, lse, delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def causal_flash(q, k, v, d: int, block: int, scale: float, interpret: bool):
    """Causal attention on `[b, t, h * d]` arrays (heads side by side in the last axis)."""
    return _forward(q, k, v, d, block, scale, interpret)[0]


def _fwd(q, k, v, d, block, scale, interpret):
    out, lse = _forward(q, k, v, d, block, scale, interpret)
    return out, (q, k, v, out, lse)


def _bwd(d, block, scale, interpret, res, dout):
    q, k, v, out, lse = res
    return tuple(_backward(q, k, v, out, lse, dout, d, block, scale, interpret))


causal_flash.defvjp(_fwd, _bwd)


def _local_attention(q, k, v, q_seg, k_seg, *, scale):
    """One device's causal attention, `[b, t, h, d]` in and out: this kernel where it applies, splash elsewhere."""
    if q_seg is not None or not supports(q.shape, k.shape):
        return local_splash(q, k, v, q_seg, k_seg, kind="causal", window=None, scale=scale)
    b, t, h, d = q.shape
    flat = lambda x: x.reshape(b, t, h * d)  # noqa: E731  (a free reshape: heads side by side)
    block = math.gcd(BLOCK, t)
    out = causal_flash(flat(q), flat(k), flat(v), d, block, scale, interpret())
    return out.reshape(q.shape)


def flash_attention(
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
) -> Float[Array, "b t h d"]:
    """Causal flash attention in this module's Pallas kernel (TPU; interpret mode elsewhere);
    any other mask, segment ids or shape `supports` refuses go to `splash_attention`, whose
    conditions (positions `0..len-1`, lengths multiples of 128) hold for both."""
    if type(mask) is not CausalMask or q_seg is not None or k_seg is not None:
        return splash_attention(q, k, v, mask=mask, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, scale=scale)
    check_lengths(q.shape[1], k.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return on_local_shards(functools.partial(_local_attention, scale=scale), q, k, v, None, None)


__all__ = ["flash_attention", "causal_flash", "supports", "BLOCK", "MAX_SEQ"]
