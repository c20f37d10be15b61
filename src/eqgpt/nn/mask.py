"""Attention masks as objects that answer "may query position i attend key position j?".

A mask works on *global* positions, so the same object serves a whole sequence, a
block of it, or a shard of it held by one device (ring attention, zigzag layouts).
Positions are integer arrays; they need not be contiguous.

- `__call__(q_pos, k_pos, q_seg, k_seg)` gives the elementwise boolean mask.
- `block_may_attend(q_pos, k_pos)` says, from positions alone, whether any pair of a
  query block and a key block may attend, so kernels can skip whole blocks.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class Mask(eqx.Module):
    """Base mask: every query may attend every key (bidirectional).

    Subclasses override `_allowed` and `block_may_attend`.
    """

    def _allowed(
        self, q_pos: Int[Array, "q 1"], k_pos: Int[Array, "1 k"]
    ) -> Bool[Array, "q k"]:
        return jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)

    def __call__(
        self,
        q_pos: Int[Array, " q"],
        k_pos: Int[Array, " k"],
        q_seg: Int[Array, "*batch q"] | None = None,
        k_seg: Int[Array, "*batch k"] | None = None,
    ) -> Bool[Array, "*batch q k"]:
        """Elementwise mask for queries at `q_pos` and keys at `k_pos`.

        **Arguments:**

        - `q_pos`, `k_pos`: global positions of the queries and keys.
        - `q_seg`, `k_seg`: optional segment (document) ids; pairs in different
          segments never attend. Both or neither must be given.

        **Returns:** a boolean array, True where attention is allowed.
        """
        allowed = self._allowed(q_pos[:, None], k_pos[None, :])
        if (q_seg is None) != (k_seg is None):
            raise ValueError("Pass both q_seg and k_seg, or neither.")
        if q_seg is not None:
            allowed = allowed & (q_seg[..., :, None] == k_seg[..., None, :])
        return allowed

    def block_may_attend(
        self, q_pos: Int[Array, " q"], k_pos: Int[Array, " k"]
    ) -> Bool[Array, ""]:
        """True unless positions alone prove that no pair in the block may attend."""
        del q_pos, k_pos
        return jnp.array(True)


class FullMask(Mask):
    """No masking: bidirectional attention."""


class CausalMask(Mask):
    """Query i attends keys j <= i."""

    def _allowed(self, q_pos, k_pos):
        return k_pos <= q_pos

    def block_may_attend(self, q_pos, k_pos):
        return jnp.min(k_pos) <= jnp.max(q_pos)


class SlidingWindowMask(Mask):
    """Causal attention to the last `window` keys: i - window < j <= i."""

    window: int = eqx.field(static=True)

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"SlidingWindowMask needs window >= 1, got {window}.")
        self.window = window

    def _allowed(self, q_pos, k_pos):
        return (k_pos <= q_pos) & (k_pos > q_pos - self.window)

    def block_may_attend(self, q_pos, k_pos):
        return (jnp.min(k_pos) <= jnp.max(q_pos)) & (
            jnp.max(k_pos) > jnp.min(q_pos) - self.window
        )


def make_mask(kind: str, window: int | None = None) -> Mask:
    """Build a mask by name: "causal", "sliding" (needs `window`) or "full".

    Document (segment) masking is not a separate kind: pass segment ids to any
    mask and pairs in different documents never attend.
    """
    if kind == "causal":
        return CausalMask()
    if kind == "sliding":
        if window is None:
            raise ValueError('mask "sliding" needs a window size (e.g. window=256).')
        return SlidingWindowMask(window)
    if kind == "full":
        return FullMask()
    raise ValueError(f'Unknown mask {kind!r}; choose "causal", "sliding" or "full".')


class DocumentMask(Mask):
    """Packed sequences: `inner` masking within a document, nothing across documents.

    Any mask honours segment ids when given; this one insists on them, so a packed
    batch can never silently attend across document boundaries.
    """

    inner: Mask

    def __init__(self, inner: Mask | None = None):
        self.inner = CausalMask() if inner is None else inner

    def __call__(self, q_pos, k_pos, q_seg=None, k_seg=None):
        if q_seg is None or k_seg is None:
            raise ValueError(
                "DocumentMask needs segment ids: pass q_seg and k_seg (one id per token)."
            )
        return self.inner(q_pos, k_pos, q_seg, k_seg)

    def block_may_attend(self, q_pos, k_pos):
        return self.inner.block_may_attend(q_pos, k_pos)
