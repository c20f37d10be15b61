"""Sequence layouts for context parallelism: which global positions each device holds.

The sequence of `T` tokens is split over the `n` devices of the `context` axis.
A *layout* is a permutation of `0..T-1`: the sharded arrays hold the tokens in
layout order, and device `i` holds the `i`-th contiguous slice of length `T/n`.

- `"contiguous"`: device `i` holds positions `[i T/n, (i+1) T/n)`. Under a causal
  mask device `n-1` attends to the whole prefix and device 0 to almost nothing.
- `"zigzag"`: cut the sequence into `2n` chunks; device `i` holds chunks `i` and
  `2n-1-i`. Every device gets one early and one late chunk, so causal work is
  equal on every device.

The permutation is applied once to the batch (tokens, targets, loss mask, segment
ids) and gives the positions that RoPE, learned position embeddings and the masks
use; no layer ever reorders anything. The loss is a mean over tokens, which a
permutation does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

Ordering = Literal["zigzag", "contiguous"]
ORDERINGS: tuple[str, ...] = ("zigzag", "contiguous")


def check_layout(seq_len: int, size: int, ordering: str) -> None:
    """Raise `ValueError` unless `seq_len` tokens can be laid out over `size` devices."""
    if ordering not in ORDERINGS:
        raise ValueError(f"unknown context ordering {ordering!r}; choose one of {ORDERINGS}.")
    if size < 1:
        raise ValueError(f"context axis size must be >= 1, got {size}.")
    parts = 2 * size if ordering == "zigzag" else size
    if seq_len % parts:
        what = f"2 * context = {parts} chunks" if ordering == "zigzag" else f"{parts} shards"
        raise ValueError(
            f"{ordering} ordering cuts the sequence into {what}, but the sequence has "
            f"{seq_len} tokens; use a sequence length divisible by {parts} "
            f"(e.g. {seq_len + (-seq_len) % parts})."
        )


def layout_positions(seq_len: int, size: int, ordering: Ordering = "zigzag") -> np.ndarray:
    """The global position held at each slot of the laid-out sequence.

    **Arguments:** `seq_len`; `size`, devices on the context axis; `ordering`.

    **Returns:** an int32 numpy permutation of `0..seq_len-1`; slots
    `[i * seq_len/size, (i+1) * seq_len/size)` live on device `i`.
    """
    check_layout(seq_len, size, ordering)
    if ordering == "contiguous":
        return np.arange(seq_len, dtype=np.int32)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * size, seq_len // (2 * size))
    order = [c for i in range(size) for c in (i, 2 * size - 1 - i)]
    return chunks[order].reshape(-1)


def device_positions(seq_len: int, size: int, ordering: Ordering = "zigzag") -> np.ndarray:
    """`layout_positions` as `[size, seq_len/size]`: row `i` is what device `i` holds."""
    return layout_positions(seq_len, size, ordering).reshape(size, -1)


def to_layout(
    x: Shaped[Array, "*lead seq *rest"] | np.ndarray, size: int, ordering: Ordering = "zigzag", *, axis: int = 1
) -> Shaped[Array, "*lead seq *rest"]:
    """Reorder `x` along `axis` (the sequence) from natural order to the layout."""
    perm = layout_positions(x.shape[axis], size, ordering)
    return jnp.take(jnp.asarray(x), jnp.asarray(perm), axis=axis)


def from_layout(
    x: Shaped[Array, "*lead seq *rest"] | np.ndarray, size: int, ordering: Ordering = "zigzag", *, axis: int = 1
) -> Shaped[Array, "*lead seq *rest"]:
    """Undo `to_layout`: back to natural order along `axis`."""
    perm = layout_positions(x.shape[axis], size, ordering)
    return jnp.take(jnp.asarray(x), jnp.asarray(np.argsort(perm)), axis=axis)


BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "doc_positions")


def layout_batch(
    batch: Mapping[str, Array], size: int, ordering: Ordering = "zigzag"
) -> dict[str, Array]:
    """Reorder a language-model batch once, and add the global `positions`.

    **Arguments:** `batch`, a mapping with `[batch, seq]` arrays `tokens`, `targets`
    and optionally `loss_mask`, `segment_ids`; `size`, the context axis size;
    `ordering`.

    **Returns:** a new dict with those arrays in layout order and `positions`
    (int32 `[seq]`), the global position of every slot.
    """
    if "tokens" not in batch or "targets" not in batch:
        raise ValueError(f"batch needs 'tokens' and 'targets'; got keys {sorted(batch)}.")
    seq_len = batch["tokens"].shape[1]
    for name in BATCH_KEYS:
        if name in batch and batch[name] is not None and batch[name].shape[:2] != batch["tokens"].shape:
            raise ValueError(f"batch[{name!r}] has shape {batch[name].shape}; expected {batch['tokens'].shape}.")
    out = {name: to_layout(batch[name], size, ordering) for name in BATCH_KEYS
           if name in batch and batch[name] is not None}
    out["positions"] = jnp.asarray(layout_positions(seq_len, size, ordering))
    return out




__all__ = [
    "ORDERINGS", "Ordering", "check_layout", "layout_positions", "device_positions",
    "to_layout", "from_layout", "layout_batch", "BATCH_KEYS",
]
