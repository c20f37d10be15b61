"""Reference attention: one einsum, an fp32 softmax, quadratic memory. The oracle."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.mask import Mask


def group_queries(
    q: Float[Array, "b t h d"], kv_heads: int
) -> Float[Array, "b t g r d"]:
    """Split query heads into `kv_heads` groups of `h // kv_heads` (GQA/MQA)."""
    b, t, h, d = q.shape
    if h % kv_heads:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads}).")
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


def _heads_first(x: Array) -> Array:
    """`[b, t, g, r, d]` -> `[b, g, r * t, d]`, or `[b, s, g, d]` -> `[b, g, s, d]`: each attention
    matmul then has two batch dimensions, not three (XLA:CPU runs a matmul with several batch
    dimensions, and its gradient, far slower). `g` stays its own dimension, so a sharding of the
    heads (tensor parallelism) carries through unchanged."""
    if x.ndim == 5:
        b, t, g, r, d = x.shape
        return x.transpose(0, 2, 3, 1, 4).reshape(b, g, r * t, d)
    return x.transpose(0, 2, 1, 3)


def _heads_last(x: Array, t: int, r: int) -> Array:
    """`[b, g, r * t, d]` -> `[b, t, g, r, d]` (inverse of `_heads_first` on queries)."""
    b, g, _, d = x.shape
    return x.reshape(b, g, r, t, d).transpose(0, 3, 1, 2, 4)


def _probs_and_out(q, k, v, bias, scale, r):
    """On heads-first operands: fp32 probabilities `[b, g, r * t, s]` and the output."""
    scores = jnp.matmul(q, k.swapaxes(-1, -2), preferred_element_type=jnp.float32)
    b, g, rt, s = scores.shape
    scores = scores.reshape(b, g, r, rt // r, s).astype(jnp.float32) * scale + bias
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, g, rt, s)
    return probs, jnp.matmul(probs.astype(v.dtype), v)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(q, k, v, bias, scale, r):
    """`softmax(q k^T * scale + bias) v` on heads-first operands (`_heads_first`); the backward below."""
    return _probs_and_out(q, k, v, bias, scale, r)[1]


def _attend_fwd(q, k, v, bias, scale, r):
    probs, out = _probs_and_out(q, k, v, bias, scale, r)
    return out, (q, k, v, bias, probs, out)


def _attend_bwd(scale, r, res, d_out):
    """The textbook attention backward, with `rowsum(dP * P)` taken as `rowsum(dO * O)`.

    The two are equal; the second reduces over `head_dim` instead of the keys, and
    lets XLA:CPU fuse `dS = P * (dP - delta)` as one elementwise pass after the
    `dP` matmul (autodiff of the softmax fused the key reduction into that matmul,
    the slowest op of a small model's backward pass).
    """
    q, k, v, bias, probs, out = res
    f32 = jnp.float32
    d_v = jnp.matmul(probs.astype(v.dtype).swapaxes(-1, -2), d_out)
    d_probs = jnp.matmul(d_out, v.swapaxes(-1, -2), preferred_element_type=f32)
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
    d_scores = (probs * (d_probs - delta) * scale).astype(q.dtype)
    d_q = jnp.matmul(d_scores, k)
    d_k = jnp.matmul(d_scores.swapaxes(-1, -2), q)
    return d_q, d_k, d_v.astype(v.dtype), jnp.zeros_like(bias)


_attend.defvjp(_attend_fwd, _attend_bwd)


def reference_attention(
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
    """Softmax attention computed densely, with the softmax in fp32.

    Rows with no allowed key (possible only with unusual masks) return zeros.

    The mask enters as an additive fp32 bias (`0` allowed, a large finite negative
    value not) of shape `[t, s]` (or `[b, t, s]`), and fully masked rows are zeroed
    on the `[b, t, h]` output. Neither needs the mask at the full `[b, g, r, t, s]`
    shape in the backward pass: a `jnp.where` there would make the layer scan save
    (and XLA:CPU read back) broadcast masks as large as the scores themselves.
    For any row with an allowed key the result equals the `where` form exactly.
    The gradient is written out (`_attend_bwd`), the standard one, reading the
    saved probabilities.
    """
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qg = group_queries(q, k.shape[2])
    allowed = mask(q_pos, k_pos, q_seg, k_seg)  # [t, s] or [b, t, s]
    # Half of float32's lowest: adding it to any score stays finite (no -inf, no NaN).
    bias = jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min / 2).astype(jnp.float32)
    bias = bias[:, None, None] if bias.ndim == 3 else bias
    g = k.shape[2]
    out = _attend(_heads_first(qg), _heads_first(k), _heads_first(v), jax.lax.stop_gradient(bias), float(scale),
                  h // g)
    out = _heads_last(out, t, h // g).reshape(b, t, h, d)
    any_key = jnp.any(allowed, axis=-1)  # [t] or [b, t]
    any_key = any_key[:, :, None, None] if any_key.ndim == 2 else any_key[None, :, None, None]
    return jnp.where(any_key, out, jnp.zeros((), out.dtype))
