"""Grouped matmul for dropless MoE: rows sorted by group, each group times its own matrix.

`grouped_matmul(x, w, sizes)` computes `x[rows of group e] @ w[e]` for every group `e`
with one of two kernels:

- `ragged_dot`: `jax.lax.ragged_dot`, anywhere, partitioned by GSPMD like any op;
- `megablox`: JAX's Pallas grouped matmul for TPU
  (`jax.experimental.pallas.ops.tpu.megablox.gmm`), interpret mode off TPU. Its rows are
  padded to its row tile (the padding joins the last group and is dropped). Inside a
  type-checked `shard_map` it runs through `eqgpt.nn.kernels.typed`; under an automatic
  mesh, which cannot split a Pallas call, `auto` keeps `ragged_dot`.

`auto` picks `megablox` on a TPU outside an automatic mesh, `ragged_dot` elsewhere. On a
v5e, with `default_tile`, it measured 1.03x to 1.09x `ragged_dot` forward + backward
(`benchmarks/grouped_matmul_speed.py`, docs/parallelism/expert.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.sharding import get_abstract_mesh
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.platform import interpret, target_platform
from eqgpt.nn.kernels.typed import can_call_pallas, in_manual_region, typed_call

GROUPED_KERNELS = ("auto", "ragged_dot", "megablox")


def default_tile(k: int, n: int) -> tuple[int, int, int]:
    """megablox's `(rows, contraction, columns)` tile: 512 rows and up to 768 of each width, the
    fastest of `benchmarks/grouped_matmul_speed.py --tiles` on a v5e (its own 128^3 was 10x slower)."""
    return 512, min(768, -(-k // 128) * 128), min(768, -(-n // 128) * 128)


def auto_grouped_kernel(platform: str | None = None) -> str:
    """The kernel `auto` runs here: `megablox` on TPU unless GSPMD would have to split it."""
    platform = target_platform() if platform is None else platform
    mesh = get_abstract_mesh()
    automatic = any(mesh.shape[a] > 1 and a not in mesh.manual_axes for a in mesh.axis_names)
    return "megablox" if platform == "tpu" and not automatic and can_call_pallas() else "ragged_dot"


def _megablox(x, w, sizes, tile):
    m = x.shape[0]
    pad = -m % tile[0]
    x = jnp.pad(x, ((0, pad), (0, 0)))
    sizes = sizes.at[-1].add(pad)  # padded rows join the last group, and are dropped below
    out = gmm(x, w, sizes, x.dtype, tile, None, None, False, interpret())
    return out[:m]


def grouped_matmul(
    x: Float[Array, "rows k"], w: Float[Array, "groups k n"], sizes: Int[Array, " groups"], *, kernel: str = "auto",
    tile: tuple[int, int, int] | None = None,
) -> Float[Array, "rows n"]:
    """`x`'s rows, sorted by group with `sizes[e]` in group `e`, each times `w[e]` (`tile`: megablox's
    `(rows, contraction, columns)` tile)."""
    if kernel not in GROUPED_KERNELS:
        raise ValueError(f"Unknown grouped matmul kernel {kernel!r}; choose one of {GROUPED_KERNELS}.")
    kernel = auto_grouped_kernel() if kernel == "auto" else kernel
    w = w.astype(x.dtype)
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    sizes = sizes.astype(jnp.int32)
    tile = default_tile(*w.shape[1:]) if tile is None else tile
    if in_manual_region():
        return typed_call(lambda x, w, sizes: _megablox(x, w, sizes, tile), (x, w), (sizes,))
    return _megablox(x, w, sizes, tile)


__all__ = ["grouped_matmul", "auto_grouped_kernel", "GROUPED_KERNELS"]
