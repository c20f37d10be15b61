"""Compile accounting: which jitted functions compiled, how often, for how long, by phase.

`CompileLog` reads `jax.monitoring`'s compile events (trace, lowering to MLIR, backend
compile; a persistent-cache read counts as a backend compile, a fast one) by function
name, from its creation on. The recipe groups the seconds into phases by those names
(`PHASES`; every other program is `other`) and prints them apart from training:

    compiled in 41 s (train 18, eval 9, sample 14, other 0), trained 30 steps in 4 s

Tests read `counts` to prove that each program compiles once per run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TypeVar

import jax

TRACE, LOWER, COMPILE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                         "/jax/core/compile/backend_compile_duration")
PHASES = {"step": "train", "evaluate": "eval", "_generate_rows": "sample"}
"""Jitted function name -> phase (`make_train_step`'s `step`, `make_eval_fn`'s `evaluate`, the sampler)."""

_records: list[tuple[str, str, float, int]] = []  # (event, function, seconds, thread) of this process
_lock = threading.Lock()
T = TypeVar("T")


def _name(fun_name: str) -> str:
    """'jit(step)', 'jit_step' and 'step' alike: 'step'."""
    if fun_name.startswith("jit(") and fun_name.endswith(")"):
        return fun_name[4:-1]
    return fun_name.removeprefix("jit_")


def _listen(event: str, seconds: float, **kwargs) -> None:
    if event in (TRACE, LOWER, COMPILE):
        with _lock:
            _records.append((event, _name(str(kwargs.get("fun_name", "?"))), seconds, threading.get_ident()))


def _ensure_listening() -> None:
    with _lock:  # jax.monitoring has no public way to remove a listener: one for the process
        if not getattr(_listen, "registered", False):
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _listen.registered = True


class CompileLog:
    """This process's compiles from now (until `with CompileLog() as log:` exits, or on)."""

    def __init__(self) -> None:
        _ensure_listening()
        self._start, self._end = len(_records), None
        self.trained: tuple[int, float] | None = None

    def __enter__(self) -> CompileLog:
        return self

    def __exit__(self, *exc) -> None:
        self._end = len(_records)

    def _records(self) -> list[tuple[str, str, float, int]]:
        with _lock:
            return _records[self._start:self._end]

    @property
    def counts(self) -> Counter[str]:
        """Backend compiles (persistent-cache reads included) per function name."""
        return Counter(name for event, name, _, _ in self._records() if event == COMPILE)

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds of trace, lowering and compile per function name."""
        out: defaultdict[str, float] = defaultdict(float)
        for _, name, secs, _ in self._records():
            out[name] += secs
        return dict(out)

    def repeated(self) -> dict[str, int]:
        """The functions compiled more than once, with their counts."""
        return {name: n for name, n in self.counts.items() if n > 1}

    def phases(self) -> dict[str, float]:
        """Seconds per phase (`PHASES`; every other function is `other`)."""
        out = dict.fromkeys((*dict.fromkeys(PHASES.values()), "other"), 0.0)
        for name, secs in self.seconds.items():
            out[PHASES.get(name, "other")] += secs
        return out

    def _here(self) -> float:
        """Seconds compiling on this thread (others compile alongside, not in its way)."""
        me = threading.get_ident()
        return sum(secs for _, _, secs, thread in self._records() if thread == me)

    def training(self, run: Callable[[], T], steps_before: int) -> T:
        """`run()` (the training loop), timed without the compiles it waited for; the state it
        returns has a `.step`, so the line can say how many steps ran."""
        start, compiled = time.perf_counter(), self._here()
        state = run()
        wall = time.perf_counter() - start - (self._here() - compiled)
        self.trained = (int(state.step) - steps_before, wall)
        return state

    def summary(self) -> str:
        """'compiled in 41 s (train 18, eval 9, sample 14, other 0), trained 30 steps in 4 s' (compile
        seconds summed over threads: programs compiled side by side count in full)."""
        phases = self.phases()
        parts = ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
        line = f"compiled in {sum(phases.values()):.0f} s ({parts})"
        if self.trained is not None:
            line += f", trained {self.trained[0]} steps in {self.trained[1]:.0f} s"
        return line


__all__ = ["PHASES", "CompileLog"]
