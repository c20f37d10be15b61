"""The training data pipeline on Grain: a dataset of steps, prefetched, with checkpointable state.

Both modes are pure functions of `(seed, step)` (`BatchLoader` for random windows,
`PackedLoader` for packed documents). Grain turns one into a `MapDataset` whose
element `s` is this process's `Batch` of step `s`, and iterates it with
`ReadOptions(num_threads, prefetch_buffer_size)`: background threads build the
next batches while the step runs. The iterator's state (`{"next_index": step}`)
is what the checkpoint stores; restoring it resumes at exactly the next batch.

`GrainLoader` keeps the loader interface the trainer uses (`local_batch(step)`,
`batch_size`, `seq_len`, `seed`): asked for the step it expects next, it returns
the prefetched batch; asked for another, it moves the iterator there first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from eqgpt.data.batch import Batch
from eqgpt.data.loader import BatchLoader, check_state, loader_state
from eqgpt.data.packing import PackedLoader

log = logging.getLogger(__name__)

Mode = Literal["windows", "packed"]


@runtime_checkable
class StepSource(Protocol):
    """A loader whose batches are a pure function of `(seed, step)`."""

    batch_size: int
    seq_len: int
    seed: int

    def local_batch(self, step: int) -> Batch: ...


class GrainLoader:
    """Prefetching, checkpointable iteration over a `StepSource` with Grain.

    **Arguments:**

    - `source`: a `BatchLoader` or `PackedLoader` (anything with `local_batch(step)`).
    - `threads`: background threads building batches (`0`: build in the caller's thread).
    - `prefetch`: batches built ahead of the step.
    - `mode`: recorded in the state, so a resume with another mode is refused.

    `wait_s` accumulates the time `local_batch` blocked waiting for a batch, and
    `batches` how many it returned.
    """

    def __init__(self, source: StepSource, *, threads: int = 2, prefetch: int = 4, mode: str = "windows"):
        import grain

        if threads < 0 or prefetch < 0:
            raise ValueError(f"threads and prefetch must be >= 0, got {threads}, {prefetch}.")
        self.source, self.mode = source, mode
        self.batch_size, self.seq_len, self.seed = source.batch_size, source.seq_len, source.seed
        self._dataset = grain.MapDataset.range(2**62).map(source.local_batch)  # element s: batch of step s
        self._read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch if threads else 0)
        self._iter = None
        self._next = None  # the step the iterator yields next
        self.wait_s, self.batches = 0.0, 0

    def _iterator(self, step: int):
        if self._iter is None:
            self._iter = self._dataset.to_iter_dataset(self._read).__iter__()
            self._next = 0
        if step != self._next:
            self._iter.set_state({"next_index": int(step)})
            self._next = step
        return self._iter

    def local_batch(self, step: int) -> Batch:
        """This process's batch at `step` (prefetched when `step` follows the previous call)."""
        it = self._iterator(step)
        t0 = time.perf_counter()
        batch = next(it)
        self.wait_s += time.perf_counter() - t0
        self.batches += 1
        self._next = step + 1
        return batch

    def state(self, step: int) -> dict:
        """What a checkpoint at `step` stores: the Grain iterator state and what it depends on."""
        return {**loader_state(self, step), "grain": {"next_index": int(step)}}

    def restore(self, state: dict) -> int:
        """Resume from a checkpoint's `state`; **returns** its step. `ValueError` if the data changed."""
        check_state(self, state)
        step = int(state.get("grain", {}).get("next_index", state["step"]))
        self._iterator(step)
        return step

    def close(self) -> None:
        """Stop the prefetch threads."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "close"):
            it.close()


@dataclass(frozen=True)
class LoaderConfig:
    """How training batches are made.

    **Fields:** `mode` (`"windows"`: random windows, as always; `"packed"`: whole
    documents with segment ids), `threads` and `prefetch` (Grain background
    threads and batches ahead; `threads=0` loads in the training thread).
    """

    mode: Mode = "windows"
    threads: int = 2
    prefetch: int = 4


def make_loader(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    config: LoaderConfig = LoaderConfig(),
    docs: np.ndarray | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> GrainLoader:
    """The training loader: `windows` or `packed` batches of `tokens`, prefetched by Grain.

    `docs` are the document boundaries (`Corpus.train_docs`), needed by `packed`.
    """
    kw = dict(batch_size=batch_size, seq_len=seq_len, seed=seed, process_index=process_index,
              process_count=process_count)
    if config.mode == "windows":
        source = BatchLoader(tokens, **kw)
    elif config.mode == "packed":
        if docs is None:
            raise ValueError("mode='packed' needs document boundaries, which this corpus lacks; a token file "
                             "gets them from NAME.docs.npy beside it ([0, end_0, ..., n_tokens]); or use "
                             "mode='windows'.")
        source = PackedLoader(tokens, docs, **kw)
    else:
        raise ValueError(f"data mode must be 'windows' or 'packed', got {config.mode!r}.")
    return GrainLoader(source, threads=config.threads, prefetch=config.prefetch, mode=config.mode)


Loader = BatchLoader | PackedLoader | GrainLoader  # what the trainer takes

__all__ = ["Loader", "GrainLoader", "LoaderConfig", "Mode", "StepSource", "check_state", "make_loader"]
