"""The attention kernels against the independent NumPy definitions (`tests/references.py`):
causal, sliding-window and document masks, GQA, values and gradients.

fp32 kernels against float64 references; measured errors (max abs error over the largest
entry) are at most 1.6e-7 for values and gradients, so the tolerance is rel 1e-5. A window
one key too wide is off by 0.65.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references as ref
from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.mask import CausalMask, DocumentMask, Mask, SlidingWindowMask
from helpers import assert_within, rel_err

B, T, H, G, D = 2, 20, 4, 2, 8  # 20 keys: not a multiple of the blockwise blocks below
TOL = 1e-5
WINDOW = 5


# Small blocks: several per row, some skipped, one padded. With 8 x 7 a key block can start
# at a query block's last position (7, 21): the block test must not skip it.
BLOCKS = {"blockwise": (8, 8), "blockwise-8x7": (8, 7)}


def kernel(name):
    if name in BLOCKS:
        block_q, block_k = BLOCKS[name]
        return lambda *a, **kw: get_kernel("blockwise")(*a, block_q=block_q, block_k=block_k, **kw)
    return get_kernel(name)


def inputs(seed=0, kv_heads=G, scale=1.0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = scale * jax.random.normal(ks[0], (B, T, H, D))
    k = jax.random.normal(ks[1], (B, T, kv_heads, D))
    v = jax.random.normal(ks[2], (B, T, kv_heads, D))
    return q, k, v, jax.random.normal(ks[3], (B, T, H, D))


def segments():
    """Two rows of packed documents (ids change at different places)."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 7:], seg[0, 15:] = 1, 2
    seg[1, 3:] = 1
    return jnp.asarray(seg)


CASES = {
    "causal": (CausalMask(), lambda p, s: ref.causal_mask(p, p)),
    "sliding": (SlidingWindowMask(WINDOW), lambda p, s: ref.sliding_window_mask(p, p, WINDOW)),
    "document": (DocumentMask(), lambda p, s: ref.causal_mask(p, p)[None] & ref.document_mask(s, s)),
    "document_sliding": (DocumentMask(SlidingWindowMask(WINDOW)),
                         lambda p, s: ref.sliding_window_mask(p, p, WINDOW)[None] & ref.document_mask(s, s)),
}


def run(name, mask, seg=None, kv_heads=G, scale=1.0):
    """The kernel's output and gradients of `sum(out * d_out)` in q, k, v (queries times `scale`)."""
    q, k, v, d_out = inputs(kv_heads=kv_heads, scale=scale)
    pos = jnp.arange(T)

    def f(q, k, v):
        return kernel(name)(q, k, v, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg)

    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    return np.asarray(out), [np.asarray(g) for g in vjp(d_out)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["reference", *BLOCKS])
def test_kernel_matches_definition(name, case):
    mask, ref_mask = CASES[case]
    seg = segments() if case.startswith("document") else None
    out, grads = run(name, mask, seg)
    q, k, v, d_out = (np.asarray(a) for a in inputs())
    m = ref_mask(np.arange(T), None if seg is None else np.asarray(seg))
    assert_within(rel_err(out, ref.attention(q, k, v, m)), TOL)
    for got, want in zip(grads, ref.attention_grads(q, k, v, m, d_out), strict=True):
        assert_within(rel_err(got, want), TOL)


@pytest.mark.parametrize("name", ["reference", *BLOCKS])
def test_kernel_at_huge_scores(name):
    """Scores of order 1e2 (queries x 40): exp overflows fp32 unless each row's maximum is
    subtracted (the online softmax's running maximum, across key blocks). Measured errors are at
    most 2.1e-6 (a blockwise gradient), within the tolerance of every other case."""
    mask, ref_mask = CASES["document_sliding"]
    out, grads = run(name, mask, segments(), scale=40.0)
    q, k, v, d_out = (np.asarray(a) for a in inputs(scale=40.0))
    m = ref_mask(np.arange(T), np.asarray(segments()))
    assert np.isfinite(out).all()
    assert_within(rel_err(out, ref.attention(q, k, v, m)), TOL, "output")
    for got, want in zip(grads, ref.attention_grads(q, k, v, m, d_out), strict=True):
        assert_within(rel_err(got, want), TOL, "gradient")


@pytest.mark.parametrize("name", ["reference", "blockwise"])
def test_multi_query(name, kv_heads=1):
    out, grads = run(name, CausalMask(), kv_heads=kv_heads)
    q, k, v, d_out = (np.asarray(a) for a in inputs(kv_heads=kv_heads))
    m = ref.causal_mask(np.arange(T), np.arange(T))
    assert_within(rel_err(out, ref.attention(q, k, v, m)), TOL)
    for got, want in zip(grads, ref.attention_grads(q, k, v, m, d_out), strict=True):
        assert_within(rel_err(got, want), TOL)


@pytest.mark.parametrize("name", ["reference", "blockwise"])
def test_queries_behind_keys_use_global_positions(name):
    """Queries at the last 6 positions against all keys (a shard, or decoding)."""
    q, k, v, _ = inputs(1)
    q = q[:, -6:]
    q_pos, k_pos = jnp.arange(T - 6, T), jnp.arange(T)
    out = kernel(name)(q, k, v, mask=SlidingWindowMask(WINDOW), q_pos=q_pos, k_pos=k_pos)
    want = ref.attention(np.asarray(q), np.asarray(k), np.asarray(v), ref.sliding_window_mask(q_pos, k_pos, WINDOW))
    assert_within(rel_err(out, want), TOL)


class WiderWindow(Mask):
    """A planted bug: a sliding window that admits one key too many (i - window <= j <= i)."""

    window: int = WINDOW

    def _allowed(self, q_pos, k_pos):
        return (k_pos <= q_pos) & (k_pos >= q_pos - self.window)


@pytest.mark.parametrize("name", ["reference", "blockwise"])
def test_window_one_key_too_wide_is_caught(name):
    """The comparison above fails, by far more than its tolerance, on a window one key too wide."""
    out, _ = run(name, WiderWindow())
    q, k, v, _ = (np.asarray(a) for a in inputs())
    err = rel_err(out, ref.attention(q, k, v, ref.sliding_window_mask(np.arange(T), np.arange(T), WINDOW)))
    assert err > 100 * TOL
