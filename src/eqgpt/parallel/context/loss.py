"""Training with context parallelism: rules, the loss, and a `grad_fn` for the trainer.

The model runs under the automatic partitioner with the rule set
`context_rules(base)`: the base strategy (`dp`, `fsdp`, `tp`, or a `+` of them)
plus the activations' `seq` and `inner_seq` over `context`. Only attention is
manual (`ContextKernel`, a `shard_map` over `context`); the cross-entropy runs
on each device's own positions (`sharded_cross_entropy`). Every weight's
gradient is then a sum over tokens that lie on the `data`, `fsdp` and `context`
devices alike, and the partitioner reduces it over those axes together.

The batch is put into the layout (`zigzag` or `contiguous`) once per step,
before the embedding: tokens, targets, loss mask, segment ids and per-row
document positions are reordered,
and the global positions of the layout go to the model (`GPT.features(...,
positions=...)`), so RoPE, learned position embeddings and the masks see every
token at its true position. An MoE model's router losses are added from its
statistics over the whole sequence, and the capacity path serves tokens in the order
of their true positions, so both equal the unsplit model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from einops import rearrange
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PyTree

from eqgpt.data.batch import Batch
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.loss import add_router_losses, chunked_cross_entropy
from eqgpt.parallel.context.layout import Ordering, check_layout, layout_batch
from eqgpt.parallel.context.model import context_kernels
from eqgpt.parallel.rules import Rules, preset_rules

CP = Rules(activations={"seq": "context", "inner_seq": "context"}, name="cp")


def context_rules(base: str | Rules = "dp", *, axis: str = "context") -> Rules:
    """The rule set of a context-parallel run: `base` plus activations' `seq` over `axis`.

    **Arguments:** `base`, a strategy (`"dp"`, `"fsdp"`, `"dp+fsdp+tp"`, a `Rules`);
    `axis`, the context axis.

    **Returns:** the merged `Rules`. Raises `ValueError` if `base` already splits
    the sequence (sequence parallelism `sp` does, over `tensor`): use `tp` instead.
    """
    rules = preset_rules(base)
    taken = [a for name in ("seq", "inner_seq") for a in rules.axes(name, "activations") if a != axis]
    if taken:
        raise ValueError(
            f"rules {rules.name!r} already split the sequence over {sorted(set(taken))}; context "
            "parallelism owns the sequence dimension. Combine it with 'tp' rather than 'sp'."
        )
    cp = CP if axis == "context" else Rules(activations={"seq": axis, "inner_seq": axis}, name="cp")
    return rules.merge(cp).update(name=f"{rules.name}+cp")


def _fold(x: Array, size: int) -> Array:
    """`[b, T, ...]` -> `[size * b, T / size, ...]`, shard-major: device `i`'s positions become rows."""
    return rearrange(x, "b (n t) ... -> (n b) t ...", n=size)


def sharded_cross_entropy(
    head: Any,
    hidden: Float[Array, "batch seq embed"],
    targets: Int[Array, "batch seq"],
    *,
    mesh: Mesh,
    loss_mask: Float[Array, "batch seq"] | None = None,
    axis: str = "context",
    batch_axes: tuple[str, ...] = ("data", "fsdp"),
    chunk_size: int = 128,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Mean cross-entropy of sequence-sharded hidden states, each device on its own positions.

    `chunked_cross_entropy` scans over chunks of the sequence; scanning the
    sequence while it is split over `axis` would gather it. So each device's
    positions are first folded into rows (`[b, T, D] -> [n b, T/n, D]`, the new
    row dimension split over `(axis, *batch_axes)`: a relabelling, no data moves)
    and the scan runs over the local `T/n` positions. The mean is over all tokens.

    **Arguments:** `head`, the output layer (a tied `Embedding`, a `Linear`, or any function
    of hidden states, such as `GPT.head_logits`, which masks a padded vocabulary);
    `hidden`, `targets`, `loss_mask` with the sequence split over `axis` of `mesh`
    and the batch over `batch_axes`; `chunk_size`, `z_loss` as `chunked_cross_entropy`.

    **Returns:** `(loss, {"nll", "z_loss"})`.
    """
    size = mesh.shape[axis]
    rows = NamedSharding(mesh, P((axis, *(a for a in batch_axes if a != axis))))
    fold = lambda x: jax.lax.with_sharding_constraint(_fold(x, size), rows)  # noqa: E731
    logits_fn = head.attend if isinstance(head, Embedding) else head
    return chunked_cross_entropy(
        logits_fn, fold(hidden), fold(targets), loss_mask=None if loss_mask is None else fold(loss_mask),
        chunk_size=chunk_size, z_loss=z_loss,
    )


def context_loss_fn(
    mesh: Mesh,
    *,
    ordering: Ordering = "zigzag",
    axis: str = "context",
    chunk_size: int = 128,
    z_loss: float = 0.0,
) -> Callable[[PyTree, Batch], tuple[Array, dict]]:
    """`loss_fn(model, batch) -> (loss, aux)` of a GPT with context attention installed.

    **Arguments:**

    - `mesh`: the mesh; its `axis` splits the sequence.
    - `ordering`: `"zigzag"` (balanced under causal masks) or `"contiguous"`.
    - `chunk_size`, `z_loss`: as `eqgpt.nn.chunked_cross_entropy`.

    **Returns:** the loss function of a `Batch` in natural order; it is put into the
    layout here, once (per-row document positions too). Raises `ValueError` when
    the sequence does not fit the layout or the model has no context attention.
    A strategy differentiates it with `Policy.value_and_grad`.
    """
    size = mesh.shape[axis]

    def loss_fn(model, batch: Batch):
        check_layout(batch.tokens.shape[1], size, ordering)
        if size > 1 and not context_kernels(model):
            raise ValueError(
                "the model has no context attention; install it with "
                "eqgpt.parallel.context.use_context_attention(model, mesh, 'ring' | 'allgather' | 'ulysses')."
            )
        fields = {"tokens": batch.tokens, "targets": batch.targets, "loss_mask": batch.loss_mask,
                  "segment_ids": batch.segment_ids, "doc_positions": batch.positions}
        lm = layout_batch(fields, size, ordering)
        extra = {} if batch.positions is None else {"doc_positions": lm["doc_positions"]}
        # The arrays are global (the partitioner splits them), so an MoE layer's router statistics
        # are already sums over the whole sequence: the balance loss's fractions and mean
        # probabilities of each sequence are formed from all its positions, then multiplied.
        hidden, stats = model.features_and_stats(lm["tokens"], positions=lm["positions"],
                                                 segment_ids=lm.get("segment_ids"), **extra)
        loss, aux = sharded_cross_entropy(
            model.head_logits, hidden, lm["targets"], mesh=mesh, loss_mask=lm.get("loss_mask"),
            axis=axis, chunk_size=chunk_size, z_loss=z_loss,
        )
        return add_router_losses(model, loss, aux, stats, rows=batch.tokens.shape[0], tokens=batch.tokens.size)

    return loss_fn


__all__ = ["CP", "context_rules", "sharded_cross_entropy", "context_loss_fn"]
