"""Blockwise (flash) attention equals the reference kernel, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.kernels.blockwise import (
    blockwise_attention,
    blockwise_backward,
    blockwise_forward,
    merge_partials,
)
from eqgpt.nn.kernels.reference import reference_attention
from eqgpt.nn.mask import CausalMask, DocumentMask, FullMask, Mask, SlidingWindowMask

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seed, b, t, s, h, g, d=8, dtype=jnp.float32):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, h, d), dtype)
    k = jax.random.normal(kk, (b, s, g, d), dtype)
    v = jax.random.normal(kv, (b, s, g, d), dtype)
    ct = jax.random.normal(kc, (b, t, h, d), dtype)
    return q, k, v, ct


def _out_and_grads(kernel, q, k, v, ct, **kw):
    def loss(q, k, v):
        out = kernel(q, k, v, **kw)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _compare(q, k, v, ct, *, block_q, block_k, **kw):
    out_b, grads_b = _out_and_grads(
        lambda *a, **k_: blockwise_attention(*a, block_q=block_q, block_k=block_k, **k_),
        q, k, v, ct, **kw,
    )
    out_r, grads_r = _out_and_grads(reference_attention, q, k, v, ct, **kw)
    np.testing.assert_allclose(out_b, out_r, **TOL)
    for name, gb, gr in zip("qkv", grads_b, grads_r, strict=True):
        np.testing.assert_allclose(gb, gr, **TOL, err_msg=f"d{name}")


def _segments(b, t):
    # documents of uneven length that cross block boundaries (blocks of 16)
    bounds = jnp.array([[0, 5, 21, 23, 40], [0, 13, 14, 33, 40]])[:b]
    pos = jnp.arange(t)
    return jnp.sum(pos[None, :, None] >= bounds[:, None, 1:-1], axis=-1).astype(jnp.int32)


@pytest.mark.parametrize(
    "mask", [CausalMask(), SlidingWindowMask(7), FullMask(), DocumentMask()], ids=repr
)
def test_masks_match_reference(mask):
    b, t = 2, 40
    q, k, v, ct = _inputs(0, b, t, t, 4, 2)
    pos = jnp.arange(t)
    seg = _segments(b, t) if isinstance(mask, DocumentMask) else None
    _compare(
        q, k, v, ct, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg,
        block_q=16, block_k=16,
    )


def test_segments_with_sliding_window():
    b, t = 2, 40
    q, k, v, ct = _inputs(1, b, t, t, 2, 2)
    pos, seg = jnp.arange(t), _segments(b, t)
    _compare(
        q, k, v, ct, mask=DocumentMask(SlidingWindowMask(9)), q_pos=pos, k_pos=pos,
        q_seg=seg, k_seg=seg, block_q=8, block_k=16,
    )


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_grouped_heads(kv_heads):
    q, k, v, ct = _inputs(2, 1, 32, 32, 4, kv_heads)
    pos = jnp.arange(32)
    _compare(q, k, v, ct, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=8, block_k=16)


@pytest.mark.parametrize("block_q,block_k", [(16, 24), (128, 128), (7, 50)])
def test_uneven_blocks(block_q, block_k):
    q, k, v, ct = _inputs(3, 2, 50, 50, 4, 2)
    pos = jnp.arange(50)
    _compare(
        q, k, v, ct, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=block_q, block_k=block_k
    )


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowMask(10)], ids=repr)
def test_offset_queries(mask):
    q, k, v, ct = _inputs(4, 1, 16, 48, 4, 2)
    _compare(
        q, k, v, ct, mask=mask, q_pos=jnp.arange(32, 48), k_pos=jnp.arange(48),
        block_q=8, block_k=12,
    )


def test_zigzag_positions():
    # a zigzag context-parallel shard holds chunks 0 and 7 of a 64-token sequence
    shard = jnp.concatenate([jnp.arange(8), jnp.arange(56, 64)])
    q, k, v, ct = _inputs(5, 1, 16, 64, 4, 2)
    _compare(
        q, k, v, ct, mask=CausalMask(), q_pos=shard, k_pos=jnp.arange(64),
        block_q=8, block_k=8,
    )
    k2, v2 = k[:, :16], v[:, :16]  # the shard against its own keys, one mixed block
    for bq, bk in [(8, 8), (16, 16)]:
        _compare(
            q, k2, v2, ct, mask=CausalMask(), q_pos=shard, k_pos=shard, block_q=bq, block_k=bk
        )


class _ClaimsEmpty(Mask):
    """Allows every pair elementwise but tells kernels every block is empty."""

    def block_may_attend(self, q_pos, k_pos):
        return jnp.array(False)


def test_skipped_blocks_compute_nothing():
    q, k, v, ct = _inputs(6, 1, 16, 16, 2, 2)
    pos = jnp.arange(16)
    kw = dict(q_pos=pos, k_pos=pos, block_q=8, block_k=8)
    # Were the blocks computed, the output would be full attention, not zero.
    out, lse = blockwise_forward(q, k, v, mask=_ClaimsEmpty(), **kw)
    assert np.all(np.asarray(out) == 0.0)
    assert np.all(np.asarray(lse) < -1e30)
    dq, dk, dv = blockwise_backward(q, k, v, out, lse, ct, mask=_ClaimsEmpty(), **kw)
    assert all(np.all(np.asarray(x) == 0.0) for x in (dq, dk, dv))
    # The jaxprs of the forward and backward pass branch on the block test.
    fn = lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, mask=CausalMask(), **kw) * ct)
    assert "cond[" in str(jax.make_jaxpr(fn)(q, k, v))
    assert str(jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v)).count("cond[") >= 2


def test_empty_rows_are_zero():
    # causal queries at 0..7 see no key at 8..15: output and gradients are zero
    q, k, v, ct = _inputs(7, 1, 8, 8, 2, 1)
    _, grads_r = _out_and_grads(
        reference_attention, q, k, v, ct, mask=CausalMask(), q_pos=jnp.arange(8),
        k_pos=jnp.arange(8, 16),
    )
    out, grads = _out_and_grads(
        blockwise_attention, q, k, v, ct, mask=CausalMask(), q_pos=jnp.arange(8),
        k_pos=jnp.arange(8, 16),
    )
    assert np.all(np.asarray(out) == 0.0)
    for g, gr in zip(grads, grads_r, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, gr, **TOL)


def test_split_keys_merge_to_full_gradient():
    """Ring attention's contract: per-shard forward + merge, per-shard backward + sum."""
    b, t, s = 2, 32, 32
    q, k, v, ct = _inputs(8, b, t, s, 4, 2)
    pos = jnp.arange(t)
    seg = _segments(b, 40)[:, :t]
    mask = DocumentMask()
    kw = dict(mask=mask, q_pos=pos, q_seg=seg, block_q=8, block_k=8)
    halves = [slice(0, 16), slice(16, 32)]  # rows 0..15 see nothing in the second half

    @jax.jit
    def split(q, k, v, ct):
        parts = [
            blockwise_forward(q, k[:, h], v[:, h], k_pos=pos[h], k_seg=seg[:, h], **kw)
            for h in halves
        ]
        out, lse = merge_partials(*parts[0], *parts[1])
        dq, dks, dvs = 0.0, [], []
        for h in halves:
            dq_h, dk_h, dv_h = blockwise_backward(
                q, k[:, h], v[:, h], out, lse, ct, k_pos=pos[h], k_seg=seg[:, h], **kw
            )
            dq, dks, dvs = dq + dq_h, dks + [dk_h], dvs + [dv_h]
        return out, lse, (dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))

    out, lse, grads = split(q, k, v, ct)
    full_out, full_lse = blockwise_forward(q, k, v, k_pos=pos, k_seg=seg, **kw)
    np.testing.assert_allclose(lse, full_lse, **TOL)
    out_r, grads_r = _out_and_grads(
        reference_attention, q, k, v, ct, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg
    )
    np.testing.assert_allclose(out, out_r, **TOL)
    np.testing.assert_allclose(full_out, out_r, **TOL)
    for name, g, gr in zip("qkv", grads, grads_r, strict=True):
        np.testing.assert_allclose(g, gr, **TOL, err_msg=f"d{name}")


def test_lse_matches_dense_logsumexp():
    q, k, v, _ = _inputs(9, 1, 24, 24, 2, 2)
    pos = jnp.arange(24)
    _, lse = blockwise_forward(
        q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=8, block_k=16
    )
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * 8**-0.5
    scores = jnp.where(pos[None, :] <= pos[:, None], scores, -jnp.inf)
    dense = jax.nn.logsumexp(scores, axis=-1).transpose(0, 2, 1)
    np.testing.assert_allclose(lse, dense, **TOL)


def test_causality():
    t, cut = 32, 13
    q, k, v, _ = _inputs(10, 1, t, t, 4, 2)
    pos = jnp.arange(t)
    noise = _inputs(11, 1, t, t, 4, 2)
    later = (pos > cut)[None, :, None, None]
    attn = jax.jit(
        lambda q, k, v: blockwise_attention(
            q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=8, block_k=8
        )
    )
    base = attn(q, k, v)
    for i in range(3):
        changed = [q, k, v]
        changed[i] = jnp.where(later, noise[i], changed[i])
        out = attn(*changed)
        np.testing.assert_array_equal(out[:, : cut + 1], base[:, : cut + 1])
        assert not np.allclose(out[:, cut + 1 :], base[:, cut + 1 :])


def test_bf16_inputs_keep_dtype():
    q, k, v, ct = _inputs(12, 1, 32, 32, 4, 2, dtype=jnp.bfloat16)
    pos = jnp.arange(32)
    kw = dict(mask=CausalMask(), q_pos=pos, k_pos=pos)
    out, grads = _out_and_grads(
        lambda *a, **k_: blockwise_attention(*a, block_q=8, block_k=8, **k_), q, k, v, ct, **kw
    )
    out_r, _ = _out_and_grads(reference_attention, q, k, v, ct, **kw)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(
        out.astype(jnp.float32), out_r.astype(jnp.float32), rtol=2e-2, atol=2e-2
    )


def test_registry_and_bad_blocks():
    assert get_kernel("blockwise") is blockwise_attention
    q, k, v, _ = _inputs(13, 1, 8, 8, 2, 2)
    with pytest.raises(ValueError, match="block sizes"):
        blockwise_attention(
            q, k, v, mask=CausalMask(), q_pos=jnp.arange(8), k_pos=jnp.arange(8), block_q=0
        )
