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

    The mask enters as an additive fp32 bias (`0` allowed, a large finite negative
    value not) of shape `[t, s]` (or `[b, t, s]`), and fully masked rows are zeroed
    on the `[b, t, h]` output. Neither needs the mask at the full `[b, g, r, t, s]`
    shape in the backward pass: a `jnp.where` there would make the layer scan save
    (and XLA:CPU read back) broadcast masks as large as the scores themselves.
    For any row with an allowed key the result equals the `where` form exactly.
    """
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qg = group_queries(q, k.shape[2])
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    allowed = mask(q_pos, k_pos, q_seg, k_seg)  # [t, s] or [b, t, s]
    # Half of float32's lowest: adding it to any score stays finite (no -inf, no NaN).
    bias = jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min / 2).astype(jnp.float32)
    bias = bias[:, None, None] if bias.ndim == 3 else bias
    probs = jax.nn.softmax(scores.astype(jnp.float32) * scale + bias, axis=-1)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v.dtype), v).reshape(b, t, h, d)
    any_key = jnp.any(allowed, axis=-1)  # [t] or [b, t]
    any_key = any_key[:, :, None, None] if any_key.ndim == 2 else any_key[None, :, None, None]
    return jnp.where(any_key, out, jnp.zeros((), out.dtype))
