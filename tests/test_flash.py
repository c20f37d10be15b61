"""Our Pallas causal kernel (`eqgpt.nn.kernels.flash`, interpret mode on CPU) against the
independent NumPy definitions (`tests/references.py`), values and gradients, fp32.

Blocks of 128 over 256 positions, so the kernel loops over a key block below the diagonal and
masks the diagonal one; two heads of 64 share one 128-lane tile, and a tile narrower than 128
lanes (4 heads of 16) is its whole width. Measured errors (max abs error over the largest entry,
fp32 against float64) are at most 1.1e-6, so the tolerance is rel 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references as ref
from eqgpt.nn.kernels import flash, get_kernel
from eqgpt.nn.mask import CausalMask, SlidingWindowMask
from helpers import assert_within, rel_err

B, T = 2, 256
TOL = 1e-5


def inputs(heads, kv_heads, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, T, heads, d)), jax.random.normal(ks[1], (B, T, kv_heads, d)),
            jax.random.normal(ks[2], (B, T, kv_heads, d)), jax.random.normal(ks[3], (B, T, heads, d)))


def check(mask, allowed, heads, kv_heads, d):
    q, k, v, d_out = inputs(heads, kv_heads, d)
    pos = jnp.arange(T)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: get_kernel("flash")(q, k, v, mask=mask, q_pos=pos, k_pos=pos)), q, k, v)
    q, k, v, d_out = (np.asarray(a) for a in (q, k, v, d_out))
    assert_within(rel_err(out, ref.attention(q, k, v, allowed)), TOL)
    for got, want in zip(vjp(jnp.asarray(d_out)), ref.attention_grads(q, k, v, allowed, d_out), strict=True):
        assert_within(rel_err(got, want), TOL)


@pytest.mark.parametrize("heads,d", [(4, 64), (2, 128), (4, 16)], ids=["two-per-tile", "one-per-tile", "narrow"])
def test_flash_equals_the_causal_definition(heads, d, monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", 128)
    assert flash.supports((B, T, heads, d), (B, T, heads, d))
    check(CausalMask(), ref.causal_mask(np.arange(T), np.arange(T)), heads, heads, d)


def test_flash_hands_other_masks_and_gqa_to_splash():
    """A sliding window and grouped kv heads are outside the kernel: the call still equals the definition."""
    assert not flash.supports((B, T, 4, 64), (B, T, 2, 64))
    check(SlidingWindowMask(37), ref.sliding_window_mask(np.arange(T), np.arange(T), 37), 4, 2, 64)
