"""Compile ahead: programs lowered and compiled in background threads while the run starts.

`eqgpt-train` submits its validation and end-of-run sampling programs as soon as the
model is initialised; they compile while the training step compiles and the run
directory, loader and checkpoint are prepared, and each is collected where it is first
used. XLA compiles outside Python's lock, so on a host with cores to spare three
programs take about the time of the slowest. A job's lowering reads its arguments'
shapes only; `lowered()` waits for every lowering, so that the training step may then
donate the arrays they were lowered with. `compile_ahead` submits a run's two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from eqgpt.parallel.strategy import Strategy
from eqgpt.sample import lower_texts
from eqgpt.train.state import TrainState
from eqgpt.train.trainer import TrainerConfig, eval_batches


class Ahead:
    """Named compile jobs on a small thread pool: `submit(name, lower)`, later `get(name)`."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="eqgpt-compile")
        self._jobs: dict[str, tuple[threading.Event, Future]] = {}

    def submit(self, name: str, lower: Callable[[], Any]) -> None:
        """Run `lower()` (a `jax.stages.Lowered`, or equinox's; `None`: nothing to compile) then
        compile it, in the background."""
        done_lowering = threading.Event()

        def job():
            try:
                lowered = lower()
            finally:
                done_lowering.set()
            return None if lowered is None else lowered.compile()

        self._jobs[name] = (done_lowering, self._pool.submit(job))

    def lowered(self) -> None:
        """Wait until every job has lowered (its compile may go on)."""
        for event, _ in self._jobs.values():
            event.wait()

    def get(self, name: str) -> Any:
        """The compiled program of job `name` (waiting for it), or `None` if none was submitted;
        a job's error is raised here."""
        return self._jobs[name][1].result() if name in self._jobs else None

    def close(self) -> None:
        """No more jobs: the threads end once the submitted ones have."""
        self._pool.shutdown(wait=False)


def compile_ahead(state: TrainState, strategy: Strategy, eval_fn: Any, val: Any,
                  sampler: Callable[[TrainState], tuple | None] | None) -> Ahead:
    """The validation program (for the windows `val`, unless `None`) and the sampling program
    (`sampler(state)`: `generate_texts`'s arguments and key, `eqgpt.train.finish.sample_inputs`;
    `None`: no samples), compiling in background threads."""
    ahead = Ahead()
    if val is not None:
        first = eval_batches(val, TrainerConfig.eval_batch_size, strategy.batch_divisor)[0][0]
        ahead.submit("eval", lambda: eval_fn.lower(state.model, strategy.batch(first)))
    if sampler is not None:
        def lower_sampler():
            inputs = sampler(state)
            return None if inputs is None else lower_texts(*inputs[0], key=inputs[1])

        ahead.submit("sample", lower_sampler)
    ahead.close()  # no more jobs; the submitted ones run on
    return ahead


__all__ = ["Ahead", "compile_ahead"]
