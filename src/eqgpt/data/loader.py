"""Batches as a pure function of (seed, step), loaded per process.

Training batches are random windows of the training tokens. The offsets of step
`s` come from `np.random.default_rng([seed, s])`, so a resumed run, or a run on a
different number of processes, sees exactly the same global batch. Each process
reads only its own rows `[process_index * B / P, (process_index + 1) * B / P)`
and the placement assembles the global array with
`jax.make_array_from_process_local_data`.

The training loader holds only the training tokens: it cannot read validation data.
"""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import Integer

from eqgpt.data.batch import Batch


def process_rows(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """The `[start, stop)` rows of a global batch that one process loads."""
    if batch_size % process_count:
        raise ValueError(
            f"batch_size ({batch_size}) must be divisible by the number of processes "
            f"({process_count}); pick a multiple of {process_count}."
        )
    per = batch_size // process_count
    return process_index * per, (process_index + 1) * per


def loader_state(loader, step: int) -> dict:
    """What a checkpoint at `step` stores of a loader: the step, and the seed, mode and batch shape that
    fix every batch from it (`check_state` compares them on restore)."""
    return {"seed": loader.seed, "step": int(step), "mode": loader.mode, "batch_size": loader.batch_size,
            "seq_len": loader.seq_len}


def check_state(loader, state: dict) -> None:
    """`ValueError` if a checkpoint's data state was written with another seed, mode or batch shape."""
    mine = {k: v for k, v in loader_state(loader, 0).items() if k != "step"}
    diff = {k: (state[k], v) for k, v in mine.items() if k in state and state[k] != v}
    if diff:
        raise ValueError(
            "the checkpoint's data pipeline differs from this run's: "
            + ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            + "; resume with the same --data settings (or start a new run) to see the same batches."
        )



class BatchLoader:
    """Random training windows of `seq_len + 1` tokens, as `Batch`es of inputs and targets.

    **Arguments:**

    - `tokens`: 1-D training tokens (a memmap is fine: only the chosen windows are read).
    - `batch_size`: global rows per step; `seq_len`: model positions per row.
    - `seed`: with the step, fixes every batch.
    - `process_index`, `process_count`: this process's share (default: from JAX).
    """

    mode = "windows"

    def __init__(
        self,
        tokens: Integer[np.ndarray, " n"],
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}.")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"{len(tokens)} training tokens are fewer than one sequence (seq_len + 1 = "
                f"{seq_len + 1}); use a larger corpus or a shorter seq_len."
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.rows = process_rows(batch_size, self.process_index, self.process_count)

    def offsets(self, step: int) -> Integer[np.ndarray, " batch"]:
        """Start offsets of all global rows at `step` (the same on every process)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def local_windows(self, step: int) -> Integer[np.ndarray, "rows seq_plus_one"]:
        """This process's rows of the batch at `step` as `[rows, seq_len + 1]` `int32` windows."""
        start, stop = self.rows
        t = self.seq_len + 1
        return np.stack([self.tokens[o : o + t] for o in self.offsets(step)[start:stop]]).astype(np.int32)

    def local_batch(self, step: int) -> Batch:
        """This process's rows of the batch at `step`: inputs and shifted targets."""
        return Batch.from_windows(self.local_windows(step))

    def state(self, step: int) -> dict:
        """What a checkpoint at `step` stores (`loader_state`)."""
        return loader_state(self, step)

    def restore(self, state: dict) -> int:
        """Check a checkpoint's data `state` against this loader; **returns** its step."""
        check_state(self, state)
        return int(state["step"])


def eval_windows(
    tokens: Integer[np.ndarray, " n"], *, seq_len: int, num_windows: int
) -> Integer[np.ndarray, "windows seq_plus_one"]:
    """`num_windows` fixed windows spread evenly over `tokens` (the validation set).

    Deterministic, so every evaluation of a run (and of different runs) scores the
    same text. Windows overlap only if the split is shorter than `num_windows`
    sequences.
    """
    t = seq_len + 1
    if len(tokens) < t:
        raise ValueError(
            f"{len(tokens)} validation tokens are fewer than one sequence ({t}); "
            "hold out more files or shorten seq_len."
        )
    starts = np.linspace(0, len(tokens) - t, num_windows).astype(np.int64)
    return np.stack([tokens[s : s + t] for s in starts]).astype(np.int32)
