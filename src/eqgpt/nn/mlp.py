"""Feed-forward layers: GELU MLP (GPT-2) and SwiGLU (Llama)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from eqgpt.nn.axes import REGION_INPUT, ActivationHook, NoConstraint
from eqgpt.nn.linear import Linear


@jax.custom_jvp
def gelu_tanh(x: Array) -> Array:
    """GELU, tanh approximation (GPT-2's), with its derivative written out.

    The same values as `jax.nn.gelu(x, approximate=True)`; autodiff of that keeps
    several `[batch, seq, mlp]` intermediates for the backward pass, this keeps
    one (10-15% of a small model's CPU step; see `docs/profiling_results.md`).
    """
    return jax.nn.gelu(x, approximate=True)


@gelu_tanh.defjvp
def _gelu_tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    c = math.sqrt(2 / math.pi)
    th = jnp.tanh(c * (x + 0.044715 * x**3))
    dy = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + th), dy * t


class MLP(eqx.Module):
    """`down(gelu(up(x)))`, hidden width `hidden_dim`."""

    up: Linear
    down: Linear
    shard: ActivationHook

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        use_bias: bool = True,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        key: PRNGKeyArray,
    ):
        ku, kd = jax.random.split(key)
        out_std = init_std if out_init_std is None else out_init_std
        self.up = Linear(embed_dim, hidden_dim, axes=("embed", "mlp"), use_bias=use_bias, init_std=init_std, key=ku)
        self.down = Linear(hidden_dim, embed_dim, axes=("mlp", "embed"), use_bias=use_bias, init_std=out_std, key=kd)
        self.shard = NoConstraint()

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        x = self.shard(x, REGION_INPUT)  # a tensor-parallel region starts here
        h = checkpoint_name(self.up(x), "mlp_in")
        h = self.shard(gelu_tanh(h), ("batch", "inner_seq", "mlp"))
        y = checkpoint_name(self.down(h), "mlp_out")
        return self.shard(y, ("batch", "seq", "embed"))


class SwiGLU(eqx.Module):
    """`down(silu(gate(x)) * up(x))`, hidden width `hidden_dim`."""

    gate: Linear
    up: Linear
    down: Linear
    shard: ActivationHook

    def __init__(
        self,
        embed_dim: int,
        hidden_dim: int,
        *,
        use_bias: bool = False,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        out_std = init_std if out_init_std is None else out_init_std
        self.gate = Linear(embed_dim, hidden_dim, axes=("embed", "mlp"), use_bias=use_bias, init_std=init_std, key=kg)
        self.up = Linear(embed_dim, hidden_dim, axes=("embed", "mlp"), use_bias=use_bias, init_std=init_std, key=ku)
        self.down = Linear(hidden_dim, embed_dim, axes=("mlp", "embed"), use_bias=use_bias, init_std=out_std, key=kd)
        self.shard = NoConstraint()

    def __call__(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        x = self.shard(x, REGION_INPUT)  # a tensor-parallel region starts here
        g = checkpoint_name(self.gate(x), "mlp_in")
        u = checkpoint_name(self.up(x), "mlp_in")
        h = self.shard(jax.nn.silu(g) * u, ("batch", "inner_seq", "mlp"))
        y = checkpoint_name(self.down(h), "mlp_out")
        return self.shard(y, ("batch", "seq", "embed"))
