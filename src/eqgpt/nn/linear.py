"""Linear layer whose weight dimensions carry logical axis names."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqgpt.nn.axes import AxisNames
from eqgpt.nn.quant import Int8, int8_matmul
from eqgpt.tree import with_fields


def matmul_2d(x: Float[Array, "*batch k"], w: Float[Array, "k n"],
              quant: Int8 | None = None) -> Float[Array, "*batch n"]:
    """`x @ w` with the leading dimensions of `x` flattened into one first (through int8,
    `eqgpt.nn.quant.int8_matmul`, when `quant` is given).

    The same numbers as `jnp.matmul`, but XLA:CPU runs the backward pass of a
    2-D `[rows, k] @ [k, n]` far faster than that of a dot with several batch
    dimensions (about 1.7x for a `[8, 256, 256] @ [256, 1024]` layer; see
    `docs/profiling_results.md`). On GPU/TPU the reshape is free. A reshape that merges
    sharded dimensions is still a local view under the automatic path, since
    only the last (contracted) dimension stays apart.
    """
    if quant is not None:
        y = int8_matmul(x.reshape(-1, x.shape[-1]), w, quant.backward, quant.axis)
        return y.reshape(*x.shape[:-1], w.shape[-1])
    if x.ndim <= 2:
        return jnp.matmul(x, w)
    lead = x.shape[:-1]
    return jnp.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[-1])


class Linear(eqx.Module):
    """`y = x @ weight + bias`, with `weight: [in_features, out_features]`.

    `axes` names the two weight dimensions (e.g. `("embed", "mlp")`) so sharding
    rules can place the weight without knowing which module it belongs to.
    `quant` (static, `None` unless a `Policy` marks the layer inside the loss, see
    `with_quant`) runs the matmul through int8.
    """

    weight: Float[Array, "in_features out_features"]
    bias: Float[Array, " out_features"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axes: AxisNames = eqx.field(static=True)
    quant: Int8 | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: AxisNames,
        use_bias: bool = True,
        init_std: float = 0.02,
        quant: Int8 | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`, `out_features`: input and output sizes.
        - `axes`: logical names of the (input, output) weight dimensions.
        - `use_bias`: whether to add a bias (initialised to zero).
        - `init_std`: standard deviation of the normal weight initialiser.
        - `quant`: run the matmul through int8 (`eqgpt.nn.quant.Int8`); `None`: in the input's dtype.
        - `key`: a `jax.random.PRNGKey`.
        """
        if len(axes) != 2:
            raise ValueError(f"Linear needs two axis names (in, out), got {axes}.")
        self.weight = init_std * jax.random.normal(key, (in_features, out_features))
        self.bias = jnp.zeros((out_features,)) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features
        self.axes = tuple(axes)
        self.quant = quant

    def __call__(self, x: Float[Array, "*batch in_features"]) -> Float[Array, "*batch out_features"]:
        """**Arguments:** `x`, any leading dims. **Returns:** `x @ weight + bias`."""
        y = matmul_2d(x, self.weight.astype(x.dtype), self.quant)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y

    def with_quant(self, quant: Int8 | None) -> Linear:
        """This layer with another `quant` setting; the arrays are the same objects."""
        return with_fields(self, quant=quant)

    def param_axes(self) -> dict[str, AxisNames]:
        return {"weight": self.axes, "bias": (self.axes[1],)}
