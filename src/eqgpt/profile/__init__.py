"""Evidence from compiled programs: collective inventory, memory, (FLOPs in `flops`).

`report(compiled)` is what recipes print for `--report`: the collective table and
the memory table of one compiled step; `print_evidence` prints it (and `--estimate`'s
tables) for a training step. Importing this package needs nothing
beyond JAX; `rich` is imported when a table is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eqgpt.config import GPTConfig
from eqgpt.profile.collectives import (
    KINDS,
    SLICED,
    Collective,
    SummaryRow,
    collective_summary,
    collective_table,
    collectives,
    total_bytes,
)
from eqgpt.profile.estimate import Estimate, estimate
from eqgpt.profile.memory import MemoryReport, memory, memory_table
from eqgpt.profile.schedule import (
    ScheduledCollective,
    ScheduleSummary,
    matmul_flops,
    memory_bound_bytes,
    schedule,
    schedule_summary,
    schedule_table,
)


def report(compiled: Any, *, mesh: Any = None, by_phase: bool = True, title: str = "") -> str:
    """The collective and memory tables of a compiled program, as text.

    **Arguments:** `compiled`, from `jax.jit(f).lower(...).compile()` (or equinox's
    `filter_jit` equivalent); `mesh`, to name the mesh axes of each collective;
    `by_phase`, forward and backward rows apart; `title`, a prefix for the table titles.

    **Returns:** printable text. On the CPU backend, rows marked
    "all-reduce+slice" are reduce-scatters on GPU/TPU (see `eqgpt.profile.collectives`).
    """
    prefix = f"{title}: " if title else ""
    return (
        collective_table(compiled, mesh=mesh, by_phase=by_phase, title=f"{prefix}collectives per call (per device)")
        + memory_table(compiled, title=f"{prefix}memory per device")
    )


def print_evidence(compiled: Any, strategy: Any, policy: Any, config: GPTConfig, batch: int, *,
                   show_report: bool, show_estimate: bool, log: Callable[[str], None]) -> None:
    """`show_report` (--report): the step's collectives and memory per device, read from `compiled` (the
    step the run trains with, compiled); `show_estimate` (--estimate): the predicted bytes per device
    (`estimate`, from the config alone), then beside the compiled step's."""
    if not (show_report or show_estimate):
        return
    predicted = estimate(config, strategy=strategy, batch=batch, policy=policy) if show_estimate else None
    if predicted is not None:
        log(predicted.table(title=f"{strategy.describe()}: estimated memory per device (from the config alone)"))
    if show_report:
        log(report(compiled, mesh=strategy.mesh, title=strategy.describe()))
        log(schedule_table(compiled, mesh=strategy.mesh, title=f"{strategy.describe()}: exposed vs overlappable"))
    if predicted is not None:
        log(predicted.table(compiled, title=f"{strategy.describe()}: estimate vs compiled memory per device"))


__all__ = [
    "KINDS", "SLICED", "Collective", "SummaryRow", "collectives", "collective_summary", "memory_bound_bytes",
    "collective_table", "total_bytes", "Estimate", "estimate", "MemoryReport", "memory", "memory_table", "report",
    "ScheduledCollective", "ScheduleSummary", "schedule", "schedule_summary", "schedule_table", "matmul_flops",
    "print_evidence",
]
