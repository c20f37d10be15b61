"""Token and learned position embeddings; the token table can double as the head."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.nn.axes import AxisNames
from eqgpt.nn.linear import matmul_2d


class Embedding(eqx.Module):
    """A lookup table `weight: [num, dim]` whose dimensions carry logical names.

    Used for tokens (`axes=("vocab", "embed")`) and learned positions
    (`axes=(None, "embed")`). `attend` multiplies by the transposed table: the
    tied output head.
    """

    weight: Float[Array, "num dim"]
    num: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    axes: AxisNames = eqx.field(static=True)

    def __init__(
        self, num: int, dim: int, *, axes: AxisNames, init_std: float = 0.02, key: PRNGKeyArray
    ):
        self.weight = init_std * jax.random.normal(key, (num, dim))
        self.num = num
        self.dim = dim
        self.axes = tuple(axes)

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch dim"]:
        """Rows of the table for integer `ids`."""
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch num"]:
        """`x @ weight.T`: scores against every row (logits of a tied head)."""
        return matmul_2d(x, self.weight.astype(x.dtype).T)

    def param_axes(self) -> dict[str, AxisNames]:
        return {"weight": self.axes}
