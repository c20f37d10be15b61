"""Blockwise (flash) attention equals the reference kernel, values and gradients."""

from functools import partial

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


def _inputs(seed, b, t, s, h, g, d=8, dtype=np.float32):
    # numpy inputs: no eager JAX ops, so each test compiles only what it checks
    rng = np.random.default_rng(seed)
    q, ct = (rng.standard_normal((b, t, h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, s, g, d)).astype(dtype) for _ in range(2))
    return q, k, v, ct


def _compile(fn, *args):
    """jit + compile at low XLA optimisation: these tests are compile-bound."""
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})


def _out_and_grads(kernel, **kw):
    def run(q, k, v, ct):
        def loss(q, k, v):
            out = kernel(q, k, v, **kw)
            return jnp.sum(out * ct), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return run


def _compare(q, k, v, ct, *, block_q, block_k, **kw):
    blockwise = _out_and_grads(
        lambda *a, **k_: blockwise_attention(*a, block_q=block_q, block_k=block_k, **k_), **kw
    )
    reference = _out_and_grads(reference_attention, **kw)
    both = _compile(lambda *a: (blockwise(*a), reference(*a)), q, k, v, ct)
    (out_b, grads_b), (out_r, grads_r) = both(q, k, v, ct)
    np.testing.assert_allclose(out_b, out_r, **TOL)
    for name, gb, gr in zip("qkv", grads_b, grads_r, strict=True):
        np.testing.assert_allclose(gb, gr, **TOL, err_msg=f"d{name}")
    return out_b, grads_b


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


def test_segments_with_sliding_window_mqa():
    b, t = 2, 40
    q, k, v, ct = _inputs(1, b, t, t, 4, 1)
    pos, seg = jnp.arange(t), _segments(b, t)
    _compare(
        q, k, v, ct, mask=DocumentMask(SlidingWindowMask(9)), q_pos=pos, k_pos=pos,
        q_seg=seg, k_seg=seg, block_q=8, block_k=16,
    )


@pytest.mark.parametrize(
    "block_q,block_k,kv_heads", [(16, 24, 2), (128, 128, 1), (7, 50, 4)]
)
def test_uneven_blocks_and_head_groups(block_q, block_k, kv_heads):
    # t=50 is a multiple of neither block; 128 exceeds the sequence and is clamped
    q, k, v, ct = _inputs(3, 1, 50, 50, 4, kv_heads)
    pos = jnp.arange(50)
    _compare(
        q, k, v, ct, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=block_q, block_k=block_k
    )


def test_offset_queries():
    # queries at 32..47 against keys 0..47, as a later chunk of a sequence
    q, k, v, ct = _inputs(4, 1, 16, 48, 4, 2)
    _compare(
        q, k, v, ct, mask=SlidingWindowMask(20), q_pos=jnp.arange(32, 48),
        k_pos=jnp.arange(48), block_q=8, block_k=12,
    )


@pytest.mark.parametrize("own_keys,block", [(False, 8), (True, 16)])
def test_zigzag_positions(own_keys, block):
    # a zigzag context-parallel shard holds chunks 0 and 7 of a 64-token sequence
    shard = jnp.concatenate([jnp.arange(8), jnp.arange(56, 64)])
    s = 16 if own_keys else 64
    q, k, v, ct = _inputs(5, 1, 16, s, 4, 2)
    _compare(
        q, k, v, ct, mask=CausalMask(), q_pos=shard, k_pos=shard if own_keys else jnp.arange(64),
        block_q=block, block_k=block,
    )


class _ClaimsEmpty(Mask):
    """Allows every pair elementwise but tells kernels every block is empty."""

    def block_may_attend(self, q_pos, k_pos):
        return jnp.array(False)


def test_skipped_blocks_compute_nothing():
    q, k, v, ct = _inputs(6, 1, 16, 16, 2, 2)
    pos = jnp.arange(16)
    kw = dict(q_pos=pos, k_pos=pos, block_q=8, block_k=8)

    def split(q, k, v, ct):
        out, lse = blockwise_forward(q, k, v, mask=_ClaimsEmpty(), **kw)
        return out, lse, blockwise_backward(q, k, v, out, lse, ct, mask=_ClaimsEmpty(), **kw)

    # Were the blocks computed, the output would be full attention, not zero.
    out, lse, grads = _compile(split, q, k, v, ct)(q, k, v, ct)
    assert np.all(np.asarray(out) == 0.0)
    assert np.all(np.asarray(lse) < -1e30)
    assert all(np.all(np.asarray(x) == 0.0) for x in grads)
    # The jaxprs of the forward and backward pass branch on the block test.
    def fn(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, mask=CausalMask(), **kw) * ct)

    assert "cond[" in str(jax.make_jaxpr(fn)(q, k, v))
    assert str(jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v)).count("cond[") >= 2


def test_empty_rows_are_zero():
    # causal queries at 0..7 see no key at 8..15: output and gradients are zero
    q, k, v, ct = _inputs(7, 1, 8, 8, 2, 1)
    out, grads = _compare(
        q, k, v, ct, mask=CausalMask(), q_pos=jnp.arange(8), k_pos=jnp.arange(8, 16),
        block_q=4, block_k=4,
    )
    assert np.all(np.asarray(out) == 0.0)
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_split_keys_merge_to_full_gradient():
    """Ring attention's contract: per-shard forward + merge, per-shard backward + sum."""
    b, t = 2, 32
    q, k, v, ct = _inputs(8, b, t, t, 4, 2)
    pos = jnp.arange(t)
    seg = _segments(b, 40)[:, :t]
    mask = DocumentMask()
    kw = dict(mask=mask, q_pos=pos, q_seg=seg, block_q=8, block_k=8)
    halves = [slice(0, 16), slice(16, 32)]  # rows 0..15 see nothing in the second half

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
        grads = (dq, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))
        full_lse = blockwise_forward(q, k, v, k_pos=pos, k_seg=seg, **kw)[1]
        ref = _out_and_grads(
            reference_attention, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg
        )(q, k, v, ct)
        return (out, grads), lse, full_lse, ref

    (out, grads), lse, full_lse, (out_r, grads_r) = _compile(split, q, k, v, ct)(q, k, v, ct)
    np.testing.assert_allclose(lse, full_lse, **TOL)
    np.testing.assert_allclose(out, out_r, **TOL)
    for name, g, gr in zip("qkv", grads, grads_r, strict=True):
        np.testing.assert_allclose(g, gr, **TOL, err_msg=f"d{name}")


def test_lse_matches_dense_logsumexp():
    q, k, v, _ = _inputs(9, 1, 24, 24, 2, 2)
    pos = np.arange(24)
    _, lse = blockwise_forward(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask=CausalMask(),
        q_pos=jnp.arange(24), k_pos=jnp.arange(24), block_q=8, block_k=16,
    )
    scores = np.einsum("bthd,bshd->bhts", q, k) * 8**-0.5
    scores = np.where(pos[None, :] <= pos[:, None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    dense = (top + np.log(np.exp(scores - top).sum(-1, keepdims=True)))[..., 0]
    np.testing.assert_allclose(lse, dense.transpose(0, 2, 1), **TOL)


def test_causality():
    t, cut = 32, 13
    q, k, v, _ = _inputs(10, 1, t, t, 4, 2)
    noise = _inputs(11, 1, t, t, 4, 2)
    pos = jnp.arange(t)
    attn = _compile(
        lambda q, k, v: blockwise_attention(
            q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos, block_q=8, block_k=8
        ),
        q, k, v,
    )
    base = np.asarray(attn(q, k, v))
    for i in range(3):
        changed = [q.copy(), k.copy(), v.copy()]
        changed[i][:, cut + 1 :] = noise[i][:, cut + 1 :]
        out = np.asarray(attn(*changed))
        np.testing.assert_array_equal(out[:, : cut + 1], base[:, : cut + 1])
        assert not np.allclose(out[:, cut + 1 :], base[:, cut + 1 :])


def test_bf16_inputs_keep_dtype():
    q, k, v, ct = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(12, 1, 32, 32, 4, 2))
    pos = jnp.arange(32)
    kw = dict(mask=CausalMask(), q_pos=pos, k_pos=pos)
    blockwise = _out_and_grads(partial(blockwise_attention, block_q=8, block_k=8), **kw)
    run = _compile(lambda *a: (blockwise(*a), reference_attention(*a[:3], **kw)), q, k, v, ct)
    (out, grads), out_r = run(q, k, v, ct)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(out_r, np.float32), rtol=2e-2, atol=2e-2
    )


def test_registry_and_bad_blocks():
    assert get_kernel("blockwise") is blockwise_attention
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(13, 1, 8, 8, 2, 2))
    with pytest.raises(ValueError, match="block sizes"):
        blockwise_attention(
            q, k, v, mask=CausalMask(), q_pos=jnp.arange(8), k_pos=jnp.arange(8), block_q=0
        )
