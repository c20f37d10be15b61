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
import sys
import threading
from collections.abc import Callable

import jax

# Exit status of a run that stopped on SIGTERM/SIGINT after writing its checkpoint:
# EX_TEMPFAIL ("try again later"). Distinct from crashes (1) and from being killed
# by a signal (128 + n), so a scheduler or wrapper can requeue exactly these runs.
PREEMPTED_EXIT_CODE = 75
INTERRUPTED_EXIT_CODE = 130  # a second Ctrl-C: stopped at once, without a checkpoint (128 + SIGINT)
STOP_GRACE_S = 10.0  # seconds a stop request waits for the loop to take it before the process exits


class Stopped(BaseException):  # noqa: N818 - not an error: the run was asked to stop
    """Raised by a `StopSignal(immediate=True)` handler: a stop before training began."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_FORCED_EXIT_HOOKS: list[Callable[[], str | None]] = []


def at_forced_exit(hook: Callable[[], str | None]) -> Callable[[], None]:
    """Run `hook()` before a stop that cannot wait exits the process (its returned text is printed);
    **returns** a function that removes it. A recipe says there which checkpoint is left, or removes a
    run directory that no step reached."""
    _FORCED_EXIT_HOOKS.append(hook)
    return lambda: _FORCED_EXIT_HOOKS.remove(hook) if hook in _FORCED_EXIT_HOOKS else None


def forced_exit(why: str, code: int = PREEMPTED_EXIT_CODE) -> None:
    """Print `why` and what the hooks say on one line, then leave at once (`os._exit`: no traceback, no
    waiting for the compile, step or validation the main thread is inside)."""
    notes = []
    for hook in list(_FORCED_EXIT_HOOKS):
        try:
            notes.append(hook())
        except Exception as e:  # noqa: BLE001 - leaving anyway; say what failed
            notes.append(f"({type(e).__name__}: {e})")
    print(" ".join([why, *filter(None, notes)]), flush=True)
    sys.stderr.flush()
    os._exit(code)


def _grace() -> float:
    return float(os.environ.get("EQGPT_STOP_GRACE_S", STOP_GRACE_S))


class StopSignal:
    """Catches SIGTERM and SIGINT while active (a context manager) and reports them per step.

    A second SIGINT in a single process stops at once, without a checkpoint, with one line and
    exit status 130 (never a traceback). A stop the loop has not taken within `STOP_GRACE_S`
    seconds (`EQGPT_STOP_GRACE_S`), because the main thread is inside a long compile, step or
    validation that Python cannot interrupt, ends the process from a watcher thread
    (`forced_exit`, status 75). With `immediate`, a signal raises `Stopped` in the main thread as soon
    as Python runs (a recipe's start-up, before training). Outside the main thread no handlers are
    installed and only `request()` stops the loop.
    """

    def __init__(self, *, immediate: bool = False):
        self._requested = threading.Event()
        self._taken = threading.Event()
        self.signal: int | None = None
        self.immediate = immediate
        self._old: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for (a validation in progress gives up between its batches)."""
        return self._requested.is_set()

    @property
    def multi_process(self) -> bool:
        """Several processes joined (asked without starting a backend: `jax.distributed.initialize` must
        come first, and a stop can be armed before it)."""
        return jax.distributed.is_initialized() and jax.process_count() > 1

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask the loop to stop after the current step (what the handlers do)."""
        self.signal = signum
        self._requested.set()

    def _single(self, signum, _frame):
        if self._requested.is_set() and signum == signal.SIGINT:
            forced_exit("second Ctrl-C: stopped at once, without a checkpoint.", INTERRUPTED_EXIT_CODE)
        self.request(signum)
        if self.immediate:
            self._taken.set()
            raise Stopped(signum)

    def _watch(self, read_fd: int) -> None:
        """The watcher thread: woken by the C-level handler through the wakeup fd, even while the main
        thread is inside XLA; gives the loop `_grace()` seconds to take the stop, then `forced_exit`."""
        try:
            while data := os.read(read_fd, 64):
                if not any(b in (signal.SIGTERM, signal.SIGINT) for b in data):
                    continue
                if self._taken.wait(_grace()) or self._wakeup is None:
                    return
                name = signal.Signals(self.signal or data[0]).name
                forced_exit(f"stopped by {name}: the run was inside a compile, step or validation that did not "
                            f"end within {_grace():.0f} s.")
        except OSError:
            return
        finally:
            os.close(read_fd)

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
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self._wakeup = (read_fd, write_fd)
            self._old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="eqgpt-stop-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            read_fd, write_fd = self._wakeup
            self._wakeup = None
            os.close(write_fd)  # the watcher reads end-of-file and returns
            self._taken.set()

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step`; call once per step in every process (the same steps).

        **Arguments:** `step`, the number of steps done so far.

        **Returns:** `True` at the same step in every process once any of them got a stop signal.
        """
        if not self.multi_process:
            if self._requested.is_set():
                self._taken.set()
            return self._requested.is_set()
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(int(step))
        except RuntimeError:  # preemption service disabled: fall back to the local flag
            return self._requested.is_set()
        if reached and self.signal is None:
            self.signal = signal.SIGTERM
        return reached


__all__ = ["StopSignal", "Stopped", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE", "STOP_GRACE_S", "at_forced_exit",
           "forced_exit"]
