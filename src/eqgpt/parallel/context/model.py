"""Install ring or all-gather attention into a model, without editing `eqgpt.nn`.

`use_context_attention(model, mesh, "ring")` replaces every `eqgpt.nn.Attention`
of a model (for a `GPT`: the stacked `blocks.attn`) by a `ContextAttention` that
keeps the original module, and with it the weights, the projections, RoPE, the
mask and the `checkpoint_name` tags, and swaps only the softmax for a
`ContextKernel`. `strip_context_attention` undoes it, so parameters can be
compared with (or saved for) the single-device model.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PyTree

from eqgpt.nn.attention import Attention, KVCache
from eqgpt.parallel.context.kernel import ContextKernel, Impl


class ContextAttention(eqx.Module):
    """An `Attention` whose kernel runs sequence-sharded over the context axis.

    **Fields:** `attn`, the wrapped `eqgpt.nn.Attention` (weights live there);
    `kernel`, the `ContextKernel`.
    """

    attn: Attention
    kernel: ContextKernel

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """As `Attention.__call__`; `positions` are the global positions of the layout.

        **Arguments:** `x`, `positions` (default `0..seq-1`, i.e. contiguous order),
        `segment_ids`.

        **Returns:** the attention output, shaped like `x`.
        """
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        q, k, v = self.attn.project(x, positions)
        o = self.kernel(q, k, v, mask=self.attn.mask, q_pos=positions, k_pos=positions,
                        q_seg=segment_ids, k_seg=segment_ids)
        return self.attn.output(o)

    def decode(
        self, x: Float[Array, "batch new embed"], cache: KVCache, index: Int[Array, ""]
    ) -> tuple[Float[Array, "batch new embed"], KVCache]:
        """Decoding is not sequence-sharded: the wrapped module's KV-cache step."""
        return self.attn.decode(x, cache, index)


def _is_attention(x) -> bool:
    return isinstance(x, Attention | ContextAttention)


def use_context_attention(
    model: PyTree,
    mesh: Mesh,
    impl: Impl = "ring",
    *,
    axis: str = "context",
    block_q: int = 128,
    block_k: int = 128,
) -> PyTree:
    """Replace every attention module of `model` by a `ContextAttention`.

    **Arguments:**

    - `model`: a `GPT` or any pytree holding `eqgpt.nn.Attention` modules (already
      wrapped ones get the new kernel).
    - `mesh`, `impl`, `axis`, `block_q`, `block_k`: as `ContextKernel`.

    **Returns:** the model with context attention; its arrays are the same objects.
    """
    kernel = ContextKernel(mesh, impl, axis=axis, block_q=block_q, block_k=block_k)
    found = []

    def swap(x):
        if isinstance(x, ContextAttention):
            x = x.attn
        if isinstance(x, Attention):
            found.append(x)
            return ContextAttention(x, kernel)
        return x

    out = jax.tree.map(swap, model, is_leaf=_is_attention)
    if not found:
        raise ValueError("use_context_attention found no eqgpt.nn.Attention module in the model.")
    return out


def strip_context_attention(model: PyTree) -> PyTree:
    """The model with every `ContextAttention` replaced by the `Attention` it wraps."""
    return jax.tree.map(lambda x: x.attn if isinstance(x, ContextAttention) else x, model,
                        is_leaf=_is_attention)


def context_kernels(model: PyTree) -> list[ContextKernel]:
    """The `ContextKernel`s installed in `model` (empty if none)."""
    leaves = jax.tree.leaves(model, is_leaf=_is_attention)
    return [x.kernel for x in leaves if isinstance(x, ContextAttention)]


__all__ = ["ContextAttention", "use_context_attention", "strip_context_attention", "context_kernels"]
