"""Install ring, all-gather or Ulysses attention into a model by swapping its attention *kernel*.

`use_context_attention(model, mesh, "ring")` gives every `eqgpt.nn.Attention` of a
model (for a `GPT`: the stacked `blocks.attn`) a `ContextKernel` through
`Attention.with_kernel`. Nothing else changes: the weights, projections, RoPE,
masks and `checkpoint_name` tags stay the module's own, and since a
`ContextKernel` holds no arrays the parameter tree is exactly the plain model's,
so checkpoints move freely between context-parallel and other runs.
`strip_context_attention` puts the replaced kernels back.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from eqgpt.nn.attention import Attention
from eqgpt.parallel.context.kernel import DEFAULT_BLOCK, ContextKernel


def _is_attention(x) -> bool:
    return isinstance(x, Attention)


def use_context_attention(
    model: PyTree,
    mesh: Mesh,
    config: Any = "ring",
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    batch_axes: tuple[str, ...] = (),
) -> PyTree:
    """The model with every `Attention`'s kernel replaced by a `ContextKernel`.

    **Arguments:**

    - `model`: a `GPT` or any pytree holding `eqgpt.nn.Attention` modules (ones
      that already have a context kernel get the new one).
    - `mesh`: the mesh whose `config.axis` splits the sequence.
    - `config`: an `eqgpt.parallel.context.Context`, or just the implementation ("ring", "allgather", "ulysses").
    - `block_q`, `block_k`: tile sizes on each device (default `config.block`).
    - `batch_axes`: the mesh axes of the batch (`Rules.axes("batch", "activations")`);
      Ulysses makes them manual around its all-to-alls (see `ContextKernel`).

    **Returns:** the model; its arrays are the same objects.
    """
    # A bare implementation name takes `Context`'s defaults: the `context` axis, `DEFAULT_BLOCK` tiles.
    impl, axis, block = ((config, "context", DEFAULT_BLOCK) if isinstance(config, str)
                         else (config.impl, config.axis, config.block))
    found = []

    def swap(attn):
        if not isinstance(attn, Attention):
            return attn
        found.append(attn)
        base = attn.kernel.replaces if isinstance(attn.kernel, ContextKernel) else attn.kernel
        kernel = ContextKernel(mesh, impl, axis=axis, block_q=block_q or block, block_k=block_k or block,
                               replaces=base, batch_axes=tuple(a for a in batch_axes if a in mesh.shape and a != axis))
        return attn.with_kernel(kernel)

    out = jax.tree.map(swap, model, is_leaf=_is_attention)
    if not found:
        raise ValueError("use_context_attention found no eqgpt.nn.Attention module in the model; context "
                         "parallelism swaps the kernel of Attention modules (see docs/extending.md).")
    return out


def strip_context_attention(model: PyTree) -> PyTree:
    """The model with every `ContextKernel` replaced by the kernel it stood in for."""

    def restore(attn):
        if isinstance(attn, Attention) and isinstance(attn.kernel, ContextKernel):
            return attn.with_kernel(attn.kernel.replaces)
        return attn

    return jax.tree.map(restore, model, is_leaf=_is_attention)


def context_kernels(model: PyTree) -> list[ContextKernel]:
    """The `ContextKernel`s installed in `model` (empty if none)."""
    leaves = jax.tree.leaves(model, is_leaf=_is_attention)
    return [x.kernel for x in leaves if isinstance(x, Attention) and isinstance(x.kernel, ContextKernel)]


__all__ = ["use_context_attention", "strip_context_attention", "context_kernels"]
