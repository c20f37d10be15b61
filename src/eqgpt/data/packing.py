"""Document packing: whole documents packed into rows, with segment ids and positions.

A row is `seq_len + 1` tokens (the window `Batch.from_windows` shifts by one),
holding one or more *pieces*, each a whole document or a part of a long one::

    row tokens   a0 a1 a2 a3 b0 b1 b2 c0 c1 c2 c3 c4 .  .  .  .  .
    segment_ids   1  1  1  1  2  2  2  3  3  3  3  3  0  0  0  0     (0: padding)
    positions     0  1  2  3  0  1  2  0  1  2  3  4  0  0  0  0
    loss_mask     1  1  1  0  1  1  0  1  1  1  1  0  0  0  0  0

(shown for the `seq_len` inputs; the last input of each piece would predict the
next piece's first token, so the loss ignores it, and padding too).

- **Long documents are split**, never refused: a document of more than
  `seq_len + 1` tokens becomes pieces of `seq_len + 1` tokens that overlap by one
  token, so every next-token target of the document is trained exactly once; each
  piece restarts its positions at 0 (the model's position table has `seq_len` rows).
  Documents of fewer than 2 tokens have no target and are dropped.
- **Full pieces fill a row alone; the rest are packed best-fit-decreasing** into
  rows of `seq_len + 1` slots. The plan is computed once, in numpy, from the
  document boundaries alone; it is deterministic and independent of the seed.
- **Rows are drawn by a Grain index shuffle, reshuffled every epoch**, so the
  global batch of `step` is rows `step * B ... (step + 1) * B - 1` of the shuffled,
  repeated row sequence: a pure function of `(seed, step)`, and each process
  materialises only its own rows.

Why not Grain's streaming packers (`grain.experimental.FirstFitPackIterDataset`)?
They pack a stream, so batch `s` exists only after replaying batches `0..s-1` (or
restoring their buffers); planning whole rows up front keeps random access by step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jaxtyping import Integer

from eqgpt.data.batch import Batch
from eqgpt.data.loader import check_state, loader_state, process_rows

log = logging.getLogger(__name__)


def document_pieces(
    bounds: Integer[np.ndarray, " docs_plus_one"], seq_len: int
) -> tuple[Integer[np.ndarray, " pieces"], Integer[np.ndarray, " pieces"]]:
    """`(starts, lengths)` of the pieces of every document, in document order.

    `bounds` are document boundaries `[0, end_0, end_1, ...]` into the token array.
    A piece holds at most `seq_len + 1` tokens; consecutive pieces of a document
    share one token (the last target of one is the first input of the next).
    """
    bounds = np.asarray(bounds, np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    keep = lengths >= 2
    starts, lengths = starts[keep], lengths[keep]
    n = -(-(lengths - 1) // seq_len)  # pieces per document: ceil((L - 1) / seq_len)
    first = np.repeat(starts, n)
    k = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # index of the piece within its document
    p_start = first + k * seq_len
    p_len = np.minimum(seq_len + 1, np.repeat(starts + lengths, n) - p_start)
    return p_start, p_len


@dataclass(frozen=True)
class PackPlan:
    """Which pieces each packed row holds.

    **Fields:** `seq_len`; `starts`, `lengths` of the pieces, grouped by row in
    row order; `row_ptr` (`[rows + 1]`): row `r` holds pieces `row_ptr[r]:row_ptr[r+1]`,
    laid out left to right; `split_docs`: documents longer than a row (split).
    """

    seq_len: int
    starts: np.ndarray
    lengths: np.ndarray
    row_ptr: np.ndarray
    split_docs: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    def fill(self) -> float:
        """Share of the `num_rows * (seq_len + 1)` slots that hold document tokens."""
        return float(self.lengths.sum() / (self.num_rows * (self.seq_len + 1)))


def pack_documents(bounds: Integer[np.ndarray, " docs_plus_one"], seq_len: int) -> PackPlan:
    """Plan the packing of the documents `bounds` delimits into rows of `seq_len + 1` tokens.

    Long documents are split (see the module notes; the count is logged once);
    short pieces are packed best-fit-decreasing. Raises `ValueError` if no
    document has two tokens.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}.")
    starts, lengths = document_pieces(bounds, seq_len)
    if len(starts) == 0:
        raise ValueError("no document has 2 or more tokens: nothing to pack; add text or use mode='windows'.")
    cap = seq_len + 1
    lengths_all = np.diff(np.asarray(bounds, np.int64))
    split_docs = int((lengths_all > cap).sum())
    if split_docs:
        log.info("packing: %d of %d documents are longer than seq_len + 1 = %d tokens; they are split into "
                 "pieces of %d tokens (overlapping by one), positions restarting per piece.",
                 split_docs, len(lengths_all), cap, cap)
    full = np.flatnonzero(lengths == cap)
    short = np.flatnonzero(lengths < cap)
    rows: list[list[int]] = [[int(i)] for i in full]
    # Best-fit decreasing: each piece goes to the open row with the least room that fits it.
    by_room: list[list[int]] = [[] for _ in range(cap + 1)]  # open rows by their free slots
    has_room = np.zeros(cap + 1, bool)
    bins: list[list[int]] = []
    for i in short[np.argsort(-lengths[short], kind="stable")]:
        need = int(lengths[i])
        fits = np.flatnonzero(has_room[need:])
        if len(fits):
            room = need + int(fits[0])
            b = by_room[room].pop()
            has_room[room] = bool(by_room[room])
        else:
            room, b = cap, len(bins)
            bins.append([])
        bins[b].append(int(i))
        left = room - need
        if left >= 2:  # a row with one free slot can take no piece (a piece has >= 2 tokens)
            by_room[left].append(b)
            has_room[left] = True
    rows.extend(bins)
    order = np.fromiter((i for r in rows for i in r), np.int64, count=len(starts))
    row_ptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return PackPlan(seq_len, starts[order], lengths[order], row_ptr, split_docs)


def packed_windows(
    tokens: Integer[np.ndarray, " n"], plan: PackPlan, rows: Integer[np.ndarray, " rows"]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of the plan as `[rows, seq_len + 1]` arrays: tokens, segment ids, positions, target mask.

    The target mask marks slots whose *next* slot is the same piece's next token.
    """
    t = plan.seq_len + 1
    out = np.zeros((len(rows), t), np.int32)
    seg = np.zeros((len(rows), t), np.int32)
    pos = np.zeros((len(rows), t), np.int32)
    has_target = np.zeros((len(rows), t), np.float32)
    for j, r in enumerate(rows):
        col = 0
        for k in range(plan.row_ptr[r], plan.row_ptr[r + 1]):
            s, n = int(plan.starts[k]), int(plan.lengths[k])
            out[j, col : col + n] = tokens[s : s + n]
            seg[j, col : col + n] = k - plan.row_ptr[r] + 1
            pos[j, col : col + n] = np.arange(n)
            has_target[j, col : col + n - 1] = 1.0
            col += n
    return out, seg, pos, has_target


class PackedLoader:
    """Packed documents as `Batch`es with segment ids, positions and a loss mask.

    The same interface as `BatchLoader`: `local_batch(step)` is a pure function of
    `(seed, step)`, and each process builds only its own rows.

    **Arguments:**

    - `tokens`: 1-D tokens; `bounds`: document boundaries `[0, end_0, ..., len(tokens)]`.
    - `batch_size` (global rows), `seq_len`, `seed`, `process_index`, `process_count`:
      as `BatchLoader`.
    """

    def __init__(
        self,
        tokens: Integer[np.ndarray, " n"],
        bounds: Integer[np.ndarray, " docs_plus_one"],
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        import grain

        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}.")
        bounds = np.asarray(bounds, np.int64)
        if bounds[-1] != len(tokens):
            raise ValueError(f"document boundaries end at {bounds[-1]}, but there are {len(tokens)} tokens.")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.plan = pack_documents(bounds, seq_len)
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.rows = process_rows(batch_size, self.process_index, self.process_count)
        # Grain's index shuffle (a Feistel permutation, O(1) memory), a new order every epoch.
        self._order = grain.MapDataset.range(self.plan.num_rows).shuffle(seed=seed).repeat()

    def row_ids(self, step: int) -> Integer[np.ndarray, " rows"]:
        """Plan rows of this process's share of the batch at `step`."""
        start, stop = self.rows
        base = step * self.batch_size
        return np.asarray([self._order[base + i] for i in range(start, stop)], np.int64)

    def local_windows(self, step: int) -> Integer[np.ndarray, "rows seq_plus_one"]:
        """This process's packed rows at `step` as `[rows, seq_len + 1]` token windows."""
        return packed_windows(self.tokens, self.plan, self.row_ids(step))[0]

    def local_batch(self, step: int) -> Batch:
        """This process's rows at `step`: inputs, targets, segment ids, positions, loss mask."""
        windows, seg, pos, has_target = packed_windows(self.tokens, self.plan, self.row_ids(step))
        shifted = Batch.from_windows(windows)
        return Batch(tokens=shifted.tokens, targets=shifted.targets, loss_mask=has_target[:, :-1],
                     segment_ids=seg[:, :-1], positions=pos[:, :-1])

    mode = "packed"

    def state(self, step: int) -> dict:
        """What a checkpoint at `step` stores (`loader_state`; the plan is a function of the corpus and `seq_len`)."""
        return loader_state(self, step)

    def restore(self, state: dict) -> int:
        """Check a checkpoint's data `state` against this loader; **returns** its step."""
        check_state(self, state)
        return int(state["step"])


def packing_efficiency(batch: Batch) -> dict[str, float]:
    """`real`: share of input slots holding document tokens; `trained`: share with a counted target."""
    seg = np.asarray(batch.segment_ids)
    return {"real": float((seg > 0).mean()), "trained": float(np.asarray(batch.loss_mask).mean())}


__all__ = ["PackPlan", "PackedLoader", "document_pieces", "pack_documents", "packed_windows", "packing_efficiency"]
