"""int8 matmuls for training: int8 x int8 products accumulated in int32, per-channel scales.

`int8_matmul(x, w, backward)` is `x @ w` for a 2-D `x: [rows, k]` and `w: [k, n]`:

- **Forward.** Each row of `x` and each column of `w` is scaled by its own absolute
  maximum over the contracted dimension (`scale = amax / 127`), rounded to the nearest
  integer in `[-127, 127]` and stored as int8; the product accumulates in int32
  (exact) and is multiplied back by `scale_x[row] * scale_w[col]`.
- **Backward `"qat"`** (straight-through): the gradients of the float product of the
  dequantized operands, `x_hat = q(x) * scale_x` and `w_hat = q(w) * scale_w`, with the
  rounding and the scales passed through as constants: `dx = dy @ w_hat.T`,
  `dw = x_hat.T @ dy`, in the compute dtype with fp32 accumulation.
- **Backward `"qt"`**: the same two products, each run as an `int8_product` too (the
  incoming gradient and the dequantized operand quantized along their new contracted
  dimension).

The residuals kept for the backward are the int8 operands and their scales (half the
bytes of bf16 activations). Attention's score and value products never come here; the
`Linear` layers a `Policy` marks do (`eqgpt.precision`, `docs/numerics.md`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float
from jaxtyping import Int8 as I8

INT8_BACKWARDS = ("qat", "qt")
_MAX = 127.0


@dataclass(frozen=True)
class Int8:
    """The int8 setting of a `Linear` (static, hashable): `backward` is `"qat"` or `"qt"`;
    `axis`, a mesh axis the contracted dimension is split over inside `shard_map` (a manual
    row-parallel layer), whose devices then agree on one scale per row and column."""

    backward: str = "qat"
    axis: str | None = None

    def __post_init__(self):
        if self.backward not in INT8_BACKWARDS:
            raise ValueError(f"Int8.backward = {self.backward!r}; choose one of {INT8_BACKWARDS}.")


def quantize(x: Float[Array, "*shape"], axis: int,
             mesh_axis: str | None = None) -> tuple[I8[Array, "*shape"], Float[Array, "*scales"]]:
    """`x` as int8 values and fp32 scales (one per slice along `axis`, kept as a size-1 dim):
    `q = round_half_even(x * (1 / scale))` clipped to 127 in magnitude, `scale = max|x| *
    fp32(1/127)` over `axis` (1 where the slice is all zero), so `x ~= q * scale`. With
    `mesh_axis`, the maximum is over every device's slice of `axis` (inside `shard_map`)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    if mesh_axis is not None:
        amax = jax.lax.pmax(amax, mesh_axis)
    scale = jnp.where(amax > 0, amax * jnp.float32(1 / _MAX), 1.0)
    # x times the reciprocal: one definition on every backend (XLA rewrites x / scale so).
    return jnp.clip(jnp.round(x * (1.0 / scale)), -_MAX, _MAX).astype(jnp.int8), scale


def int8_product(qa: I8[Array, "m k"], sa: Float[Array, "m 1"], qb: I8[Array, "k n"],
                 sb: Float[Array, "1 n"]) -> Float[Array, "m n"]:
    """`(qa @ qb) * sa * sb` in fp32, the product accumulated in int32."""
    acc = jax.lax.dot_general(qa, qb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * sa * sb


def _quantized_matmul(a: Float[Array, "m k"], b: Float[Array, "k n"]) -> Float[Array, "m n"]:
    """`a @ b` in fp32 through int8: `a` scaled per row, `b` per column."""
    return int8_product(*quantize(a, 1), *quantize(b, 0))


def int8_matmul(x: Float[Array, "m k"], w: Float[Array, "k n"], backward: str = "qat",
                mesh_axis: str | None = None) -> Float[Array, "m n"]:
    """`x @ w` through int8 (see the module docs), in the dtype `x` and `w` share; `mesh_axis`:
    the axis `k` is split over inside `shard_map` (the scales are then whole-`k` maxima, and
    the result is this device's partial sum)."""
    if x.dtype != w.dtype:
        raise ValueError(f"int8_matmul: x is {x.dtype} but w is {w.dtype}; cast w to x's dtype first.")
    return _int8_matmul(x, w, backward, mesh_axis)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _int8_matmul(x, w, backward, mesh_axis):
    return _forward(x, w, backward, mesh_axis)[0]


def _forward(x, w, backward, mesh_axis):
    (qx, sx), (qw, sw) = quantize(x, 1, mesh_axis), quantize(w, 0, mesh_axis)
    return int8_product(qx, sx, qw, sw).astype(x.dtype), (qx, sx, qw, sw)


def _backward(backward, mesh_axis, res, dy):
    qx, sx, qw, sw = res
    x_hat = (qx.astype(jnp.float32) * sx).astype(dy.dtype)
    w_hat = (qw.astype(jnp.float32) * sw).astype(dy.dtype)
    if backward == "qt":
        dx, dw = _quantized_matmul(dy, w_hat.T), _quantized_matmul(x_hat.T, dy)
    else:
        dx = jnp.matmul(dy, w_hat.T, preferred_element_type=jnp.float32)
        dw = jnp.matmul(x_hat.T, dy, preferred_element_type=jnp.float32)
    return dx.astype(dy.dtype), dw.astype(dy.dtype)


_int8_matmul.defvjp(_forward, _backward)

__all__ = ["Int8", "int8_matmul", "int8_product", "quantize"]
