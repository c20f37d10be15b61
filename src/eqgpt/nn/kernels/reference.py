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


def _probs_and_out(qg, k, v, bias, scale):
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(scores.astype(jnp.float32) * scale + bias, axis=-1)
    return probs, jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v.dtype), v)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(qg, k, v, bias, scale):
    """`softmax(q k^T * scale + bias) v` over groups `g` of `r` query heads; the backward below."""
    return _probs_and_out(qg, k, v, bias, scale)[1]


def _attend_fwd(qg, k, v, bias, scale):
    probs, out = _probs_and_out(qg, k, v, bias, scale)
    return out, (qg, k, v, bias, probs, out)


def _attend_bwd(scale, res, d_out):
    """The textbook attention backward, with `rowsum(dP * P)` taken as `rowsum(dO * O)`.

    The two are equal; the second reduces over `head_dim` instead of the keys, and
    lets XLA:CPU fuse `dS = P * (dP - delta)` as one elementwise pass after the
    `dP` matmul (autodiff of the softmax fused the key reduction into that matmul,
    the slowest op of a small model's backward pass).
    """
    qg, k, v, bias, probs, out = res
    f32 = jnp.float32
    d_v = jnp.einsum("bgrts,btgrd->bsgd", probs.astype(v.dtype), d_out)
    d_probs = jnp.einsum("btgrd,bsgd->bgrts", d_out, v, preferred_element_type=f32)
    delta = jnp.einsum("btgrd,btgrd->bgrt", d_out.astype(f32), out.astype(f32))
    d_scores = (probs * (d_probs.astype(f32) - delta[..., None]) * scale).astype(qg.dtype)
    d_q = jnp.einsum("bgrts,bsgd->btgrd", d_scores, k)
    d_k = jnp.einsum("bgrts,btgrd->bsgd", d_scores, qg)
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
    out = _attend(qg, k, v, jax.lax.stop_gradient(bias), float(scale)).reshape(b, t, h, d)
    any_key = jnp.any(allowed, axis=-1)  # [t] or [b, t]
    any_key = any_key[:, :, None, None] if any_key.ndim == 2 else any_key[None, :, None, None]
    return jnp.where(any_key, out, jnp.zeros((), out.dtype))
