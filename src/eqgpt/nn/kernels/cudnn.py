"""cuDNN flash attention through `jax.nn.dot_product_attention`; GPU only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.mask import CausalMask, FullMask, Mask, SlidingWindowMask


def cudnn_attention(
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
    """cuDNN fused attention. Raises on any backend but GPU; never falls back.

    Supports causal, sliding-window and full masks over contiguous positions
    (cuDNN's masks are positional; segment ids are passed as a dense mask).
    """
    if jax.default_backend() != "gpu":
        raise ValueError(
            f'attention kernel "cudnn" needs a GPU, but JAX runs on '
            f'"{jax.default_backend()}". Use kernel="blockwise" or "reference".'
        )
    if q.dtype not in (jnp.float16, jnp.bfloat16):
        raise ValueError(f'kernel "cudnn" needs bf16 or fp16 inputs, got {q.dtype}.')
    dense = None
    if q_seg is not None:
        dense = mask(q_pos, k_pos, q_seg, k_seg)[:, None]
    window = None
    if isinstance(mask, SlidingWindowMask):
        window = (mask.window - 1, 0)
    elif not isinstance(mask, (CausalMask, FullMask)):
        dense = mask(q_pos, k_pos, q_seg, k_seg)
        dense = dense[:, None] if dense.ndim == 3 else dense[None, None]
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=dense,
        scale=scale,
        is_causal=isinstance(mask, (CausalMask, SlidingWindowMask)),
        local_window_size=window,
        implementation="cudnn",
    )
