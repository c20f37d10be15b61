"""Reference attention: one einsum, an fp32 softmax, quadratic memory. The oracle."""

from __future__ import annotations

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
    """
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qg = group_queries(q, k.shape[2])
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * scale
    allowed = mask(q_pos, k_pos, q_seg, k_seg)  # [t, s] or [b, t, s]
    allowed = allowed[:, None, None] if allowed.ndim == 3 else allowed[None, None, None]
    big_neg = jnp.finfo(jnp.float32).min
    scores = jnp.where(allowed, scores, big_neg)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(allowed, probs, 0.0)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, d)
