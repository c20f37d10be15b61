"""LayerNorm and RMSNorm over the last (embed) axis, computed in fp32."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqgpt.nn.axes import AxisNames


class LayerNorm(eqx.Module):
    """LayerNorm with learned scale and optional bias (GPT-2 style)."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"] | None
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, use_bias: bool = True):
        self.weight = jnp.ones((dim,))
        self.bias = jnp.zeros((dim,)) if use_bias else None
        self.dim = dim
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """Normalise in fp32, return in the input dtype."""
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.astype(x.dtype)

    def param_axes(self) -> dict[str, AxisNames]:
        return {"weight": ("embed",), "bias": ("embed",)}


class RMSNorm(eqx.Module):
    """Root-mean-square norm with a learned scale (Llama style)."""

    weight: Float[Array, " dim"]
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.weight = jnp.ones((dim,))
        self.dim = dim
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """Normalise in fp32, return in the input dtype."""
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return (y * self.weight).astype(x.dtype)

    def param_axes(self) -> dict[str, AxisNames]:
        return {"weight": ("embed",)}


def make_norm(kind: str, dim: int, *, eps: float, use_bias: bool = True) -> LayerNorm | RMSNorm:
    """`"layernorm"` or `"rmsnorm"` of width `dim`."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, use_bias=use_bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f'Unknown norm {kind!r}; choose "layernorm" or "rmsnorm".')
