"""`Batch`: the one batch type every loader yields and every strategy consumes.

Rows of token windows `[batch, seq + 1]` become inputs and targets shifted by one
in exactly one place, `Batch.from_windows`. Optional fields carry what packed
documents need: a loss mask (1 counts, 0 ignores: padding), segment ids (no
attention across documents) and per-row positions.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, Int

_Ints = Int[Array | np.ndarray, "batch seq"]


class Batch(eqx.Module):
    """Inputs and targets of next-token prediction, all `[batch, seq]`.

    **Fields:**

    - `tokens`: input token ids.
    - `targets`: the token that follows each input.
    - `loss_mask`: weight per position (default: every position counts).
    - `segment_ids`: document id per position (default: one document per row).
    - `positions`: position of each token in its document (default: `0..seq-1`).

    A `Batch` is a pytree: `jax.tree.map` reaches its arrays, and placements turn
    a process's rows into global arrays field by field.
    """

    tokens: _Ints
    targets: _Ints
    loss_mask: Float[Array | np.ndarray, "batch seq"] | None = None
    segment_ids: _Ints | None = None
    positions: _Ints | None = None

    def __check_init__(self):
        shape = tuple(self.tokens.shape)
        for name in ("targets", "loss_mask", "segment_ids", "positions"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"Batch.{name} has shape {tuple(value.shape)}; every field must be "
                                 f"[batch, seq] like tokens {shape}.")

    @classmethod
    def from_windows(cls, windows: Int[Array | np.ndarray, "batch seq_plus_one"]) -> Batch:
        """Split `[batch, seq + 1]` windows into inputs and targets (the shift by one)."""
        if windows.ndim != 2 or windows.shape[1] < 2:
            raise ValueError(f"token windows must be [batch, seq + 1] with seq >= 1; got shape {windows.shape}.")
        return cls(tokens=windows[:, :-1], targets=windows[:, 1:])

    @property
    def shape(self) -> tuple[int, int]:
        """`(batch, seq)`."""
        return tuple(self.tokens.shape)

    def rows(self, start: int, stop: int) -> Batch:
        """Rows `[start, stop)` of every field."""
        return jax.tree.map(lambda a: a[start:stop], self)


__all__ = ["Batch"]
