"""Rotary position embeddings (RoPE), applied at arbitrary global positions."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rope_angles(
    positions: Int[Array, " seq"], head_dim: int, theta: float = 10000.0
) -> tuple[Float[Array, "seq half"], Float[Array, "seq half"]]:
    """cos and sin of the rotation angles for `positions` (any offsets, any order)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}.")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"],
    positions: Int[Array, " seq"] | Int[Array, "batch seq"],
    theta: float = 10000.0,
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) by position-dependent angles.

    Positions are global token indices, so a sequence shard, a KV-cache step or a
    zigzag chunk rotates exactly as the same tokens would in the full sequence.
    The rotation is done in fp32 and returned in `x.dtype`.
    """
    cos, sin = rope_angles(positions.reshape(-1), x.shape[-1], theta)  # per-row positions: [batch, seq]
    shape = (1 if positions.ndim == 1 else positions.shape[0], positions.shape[-1], 1, -1)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
