"""Stop requests (SIGTERM, SIGINT) that every process of a job acts on at the same step.

A scheduler preempts a job by sending SIGTERM (SLURM, Kubernetes, most cloud
queues), usually with a grace period; a user stops one with Ctrl-C (SIGINT). The
trainer asks `StopSignal.should_stop(step)` after every step and, when it says
yes, writes a checkpoint and exits with `PREEMPTED_EXIT_CODE`.

With several processes, stopping must happen at the *same* step everywhere, or
the processes that carry on wait forever in the next step's collectives. One
process: the handler sets a flag. Several: JAX's preemption sync manager (set up
by `jax.distributed.initialize`) catches SIGTERM in any process, the processes
agree in the background on the next safe step, and
`multihost_utils.reached_preemption_sync_point(step)` turns true at that step in
all of them. SIGINT is routed to it by re-sending SIGTERM to this process.
"""

from __future__ import annotations

import os
import signal
import threading

import jax

# Exit status of a run that stopped on SIGTERM/SIGINT after writing its checkpoint:
# EX_TEMPFAIL ("try again later"). Distinct from crashes (1) and from being killed
# by a signal (128 + n), so a scheduler or wrapper can requeue exactly these runs.
PREEMPTED_EXIT_CODE = 75


class StopSignal:
    """Catches SIGTERM and SIGINT while active (a context manager) and reports them per step.

    A second SIGINT in a single process raises `KeyboardInterrupt` (stop now,
    without a checkpoint). Outside the main thread no handlers are installed and
    only `request()` stops the loop.
    """

    def __init__(self):
        self._requested = threading.Event()
        self.signal: int | None = None
        self._old: dict[int, object] = {}

    @property
    def multi_process(self) -> bool:
        return jax.process_count() > 1

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop after the current step (what the handlers do)."""
        self.signal = signum
        self._requested.set()

    def _single(self, signum, _frame):
        if self._requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.request(signum)

    def _to_sync_manager(self, signum, _frame):
        self.request(signum)
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier owns SIGTERM

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is not threading.main_thread():
            return self
        if self.multi_process:
            # SIGTERM stays with JAX's notifier (installed by jax.distributed.initialize).
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._to_sync_manager)
        else:
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._single)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step`; call once per step in every process (the same steps).

        **Arguments:** `step`, the number of steps done so far.

        **Returns:** `True` at the same step in every process once any of them got a stop signal.
        """
        if not self.multi_process:
            return self._requested.is_set()
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(int(step))
        except RuntimeError:  # preemption service disabled: fall back to the local flag
            return self._requested.is_set()
        if reached and self.signal is None:
            self.signal = signal.SIGTERM
        return reached


__all__ = ["StopSignal", "PREEMPTED_EXIT_CODE"]
