"""`ContextKernel`: ring, all-gather or Ulysses attention behind the ordinary kernel signature.

A `ContextKernel` is called like every kernel of `eqgpt.nn.kernels`, on global
arrays `q: [b, T, h, d]`, `k, v: [b, T, g, d]` and global positions `[T]` (in
layout order, see `eqgpt.parallel.context.layout`). It wraps the per-device
function in `jax.shard_map` over the context axis *only*
(`axis_names={"context"}`): the sequence dimension is manual, split over the
axis, while every other mesh axis stays with the automatic partitioner. So a
batch split over `data`/`fsdp` and heads split over `tensor` (rules of
`eqgpt.parallel.rules`) pass through unchanged, and DP, FSDP and TP compose
with context parallelism without any code here knowing about them.

Called where the context axis is *already* manual (inside a `shard_map` over it,
as the pipeline runs its stages), the arrays are the local shards and their
positions, and the kernel runs the per-device ring / all-gather / Ulysses directly. On an
axis of size 1 it calls the kernel it replaced: there is nothing to split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Literal

import equinox as eqx
import jax
from jax.sharding import Mesh, get_abstract_mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.mask import Mask
from eqgpt.parallel.context.allgather import allgather_attention
from eqgpt.parallel.context.ring import ring_attention
from eqgpt.parallel.context.ulysses import ulysses_attention

Impl = Literal["ring", "allgather", "ulysses"]
DEFAULT_BLOCK = 128
"""The blockwise kernel's tile on each device (ring and all-gather) unless a `Context` says otherwise."""
IMPLS: tuple[str, ...] = ("ring", "allgather", "ulysses")


class ContextKernel(eqx.Module):
    """Sequence-sharded exact attention over the `axis` of `mesh`.

    **Arguments:**

    - `mesh`: the device mesh (from `eqgpt.parallel.make_mesh`).
    - `impl`: `"ring"` (k/v shards rotate with `ppermute`), `"allgather"` (k/v
      gathered once) or `"ulysses"` (all-to-all to head-sharded, the replaced kernel
      on the whole sequence of `heads/n` heads, all-to-all back); see
      `docs/parallelism/context.md` for which to choose.
    - `axis`: the mesh axis the sequence is split over.
    - `block_q`, `block_k`: tile sizes of the blockwise kernel on each device (ring
      and all-gather; Ulysses runs the replaced kernel as it is).
    - `q_chunks`: ring only: query chunks per shard and ring step (see `ring_attention`);
      `None` picks the largest of 4, 2, 1 that divides the shard into chunks of at
      least `block_q` rows.
    - `replaces`: the kernel it stands in for (restored by `strip_context_attention`).
    - `batch_axes`: Ulysses only: mesh axes the batch is split over (the rule set's
      `batch` axes). They join the `shard_map`'s manual axes, so each device exchanges
      its own rows: left to the partitioner, the batch dimension of an all-to-all
      inside a partly manual `shard_map` is gathered first.

    Tiles never exceed half a device's shard (one zigzag chunk).
    """

    mesh: Mesh = eqx.field(static=True)
    impl: str = eqx.field(static=True)
    axis: str = eqx.field(static=True)
    block_q: int = eqx.field(static=True)
    block_k: int = eqx.field(static=True)
    q_chunks: int | None = eqx.field(static=True)
    replaces: str | Callable = eqx.field(static=True)
    batch_axes: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, mesh: Mesh, impl: Impl = "ring", *, axis: str = "context",
                 block_q: int = 128, block_k: int = 128, q_chunks: int | None = None,
                 replaces: str | Callable = "reference", batch_axes: tuple[str, ...] = ()):
        if impl not in IMPLS:
            raise ValueError(f"unknown context attention {impl!r}; choose one of {IMPLS}.")
        if axis not in mesh.shape:
            raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no {axis!r} axis; build it with make_mesh.")
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}.")
        self.mesh, self.impl, self.axis = mesh, impl, axis
        if q_chunks is not None and q_chunks < 1:
            raise ValueError(f"q_chunks must be >= 1 (or None: automatic), got {q_chunks}.")
        self.block_q, self.block_k, self.q_chunks = block_q, block_k, q_chunks
        self.replaces = replaces
        unknown = [a for a in batch_axes if a not in mesh.shape or a == axis]
        if unknown:
            raise ValueError(f"batch_axes {unknown} are not mesh axes other than {axis!r}; mesh {dict(mesh.shape)}.")
        self.batch_axes = tuple(batch_axes)

    @property
    def size(self) -> int:
        """Devices on the context axis."""
        return self.mesh.shape[self.axis]

    def chunks_for(self, shard: int, block_q: int | None = None) -> int:
        """The query chunks per ring step for a local shard of `shard` tokens."""
        if self.q_chunks is not None:
            if shard % self.q_chunks:
                raise ValueError(f"q_chunks={self.q_chunks} must divide the local shard of {shard} tokens.")
            return self.q_chunks
        block_q = self.block_q if block_q is None else block_q
        return next(c for c in (4, 2, 1) if shard % c == 0 and (shard // c >= block_q or c == 1))

    def __call__(
        self,
        q: Float[Array, "b t h d"],
        k: Float[Array, "b t g d"],
        v: Float[Array, "b t g d"],
        *,
        mask: Mask,
        q_pos: Int[Array, " t"],
        k_pos: Int[Array, " t"],
        q_seg: Int[Array, "b t"] | None = None,
        k_seg: Int[Array, "b t"] | None = None,
        scale: float | None = None,
    ) -> Float[Array, "b t h d"]:
        """Attention over the whole sequence; arrays in layout order, sequence split on `axis`.

        **Arguments:** as every kernel (`eqgpt.nn.kernels`); queries and keys are the
        same tokens (self-attention), so `q_pos`/`k_pos` and `q_seg`/`k_seg` have one
        layout.

        **Returns:** the output, `[b, T, h, d]`, split over `axis` on the sequence.
        """
        t, n = q.shape[1], self.size
        if k.shape[1] != t:
            raise ValueError(f"context attention is self-attention: q has {t} positions, k has {k.shape[1]}.")
        if (q_seg is None) != (k_seg is None):
            raise ValueError("Pass both q_seg and k_seg, or neither.")
        manual = self.axis in get_abstract_mesh().manual_axes
        if n == 1 and not manual:
            return get_kernel(self.replaces)(q, k, v, mask=mask, q_pos=q_pos, k_pos=k_pos,
                                             q_seg=q_seg, k_seg=k_seg, scale=scale)
        if not manual and t % n:
            raise ValueError(
                f"the sequence ({t} tokens) must split evenly over the {n} devices of axis "
                f"{self.axis!r}; use a length divisible by {n}."
            )
        shard = t if manual else t // n
        half_shard = max(1, shard // 2)
        kw = dict(mask=mask, scale=scale, axis=self.axis, block_q=min(self.block_q, half_shard),
                  block_k=min(self.block_k, half_shard))
        manual_axes = {self.axis}
        if self.impl == "ring":
            fn = partial(ring_attention, q_chunks=self.chunks_for(shard, kw["block_q"]))
        elif self.impl == "ulysses":
            kw = dict(mask=mask, scale=scale, axis=self.axis)
            fn = partial(ulysses_attention, kernel=self.replaces)
            rows = math.prod(self.mesh.shape[a] for a in self.batch_axes)
            if not manual and q.shape[0] % rows == 0:  # else (an odd evaluation batch) the partitioner's way
                manual_axes |= set(self.batch_axes)
        else:
            fn = allgather_attention
        if manual:  # local shards already: the per-device computation itself
            return fn(q, k, v, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, **kw)
        batch = tuple(a for a in self.batch_axes if a in manual_axes) or None
        seq, tok = P(batch, self.axis), P(self.axis)
        if q_seg is None:
            def local(q, k, v, qp, kp):
                return fn(q, k, v, q_pos=qp, k_pos=kp, **kw)
            args, specs = (q, k, v, q_pos, k_pos), (seq, seq, seq, tok, tok)
        else:
            def local(q, k, v, qp, kp, qs, ks):
                return fn(q, k, v, q_pos=qp, k_pos=kp, q_seg=qs, k_seg=ks, **kw)
            args, specs = (q, k, v, q_pos, k_pos, q_seg, k_seg), (seq,) * 3 + (tok, tok, seq, seq)
        mapped = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=seq, axis_names=manual_axes)
        return mapped(*args)


__all__ = ["ContextKernel", "IMPLS", "Impl"]
