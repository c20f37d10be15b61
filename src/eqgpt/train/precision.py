"""Mixed precision: parameters in one dtype, compute in another, outputs in a third.

Parameters stay fp32 (the optimizer updates them). The loss function casts a copy
to `compute_dtype` *inside* the differentiated function, so gradients arrive in the
parameter dtype. Losses, softmax statistics and gradient sums stay fp32 whatever
the compute dtype (`eqgpt.nn.lm_loss` computes in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

_DTYPES = {"fp32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16,
           "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}


def _cast(tree: PyTree, dtype) -> PyTree:
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


@dataclass(frozen=True)
class Policy:
    """**Fields:** `param_dtype`, `compute_dtype`, `output_dtype` (names: "fp32", "bf16", "fp16")."""

    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"
    output_dtype: str = "fp32"

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ValueError(f"Policy.{f} = {getattr(self, f)!r}; choose one of {sorted(_DTYPES)}.")

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating arrays of `tree` in the parameter dtype."""
        return _cast(tree, _DTYPES[self.param_dtype])

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating arrays of `tree` in the compute dtype (a copy for the forward pass)."""
        return _cast(tree, _DTYPES[self.compute_dtype])

    def cast_to_output(self, x: Array) -> Array:
        """A result (loss, logits) in the output dtype."""
        return _cast(x, _DTYPES[self.output_dtype])

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
