"""Mixed precision: parameters in one dtype, compute in another.

Every strategy applies the same `Policy` (see `eqgpt.parallel.Strategy.grad_fn`).

Parameters stay fp32 (the optimizer updates them). The loss function casts a copy
to `compute_dtype` *inside* the differentiated function, so gradients arrive in the
parameter dtype. Losses, softmax statistics and gradient sums stay fp32 whatever
the compute dtype (`eqgpt.nn.lm_loss` computes in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PyTree

_DTYPES = {"fp32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16,
           "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}


def _cast(tree: PyTree, dtype) -> PyTree:
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


@dataclass(frozen=True)
class Policy:
    """**Fields:** `param_dtype`, `compute_dtype` (names: "fp32", "bf16", "fp16")."""

    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ValueError(f"Policy.{f} = {getattr(self, f)!r}; choose one of {sorted(_DTYPES)}.")

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating arrays of `tree` in the compute dtype (a copy for the forward pass)."""
        return _cast(tree, _DTYPES[self.compute_dtype])

    def value_and_grad(self, loss_fn: Callable) -> Callable:
        """`grad_fn(model, batch) -> ((loss, aux), grads)` of `loss_fn(model, batch) -> (loss, aux)`.

        The model is cast to the compute dtype inside the differentiated function,
        so gradients come back in the parameter dtype; loss and aux are cast to fp32.
        """

        def loss_of(model, batch):
            loss, aux = loss_fn(self.cast_to_compute(model), batch)
            return loss.astype(jnp.float32), jax.tree.map(lambda a: a.astype(jnp.float32), aux)

        return eqx.filter_value_and_grad(loss_of, has_aux=True)

    @property
    def compute(self) -> jnp.dtype:
        """The compute dtype as a NumPy dtype."""
        return jnp.dtype(_DTYPES[self.compute_dtype])

    @classmethod
    def named(cls, name: str) -> Policy:
        """`"fp32"`: everything fp32. `"bf16"`: fp32 params and outputs, bf16 compute."""
        if name in ("fp32", "float32"):
            return cls()
        if name in ("bf16", "bfloat16"):
            return cls(compute_dtype="bf16")
        raise ValueError(f"Unknown precision {name!r}; choose 'fp32' or 'bf16'.")

    @classmethod
    def default(cls, platform: str | None = None) -> Policy:
        """fp32 on CPU (bf16 is emulated there and slower); bf16 compute on GPU/TPU."""
        platform = jax.default_backend() if platform is None else platform
        return cls() if platform == "cpu" else cls(compute_dtype="bf16")
