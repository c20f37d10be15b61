"""Evidence from compiled programs: collective inventory, memory, (FLOPs in `flops`).

`report(compiled)` is what recipes print for `--report`: the collective table and
the memory table of one compiled step. Importing this package needs nothing
beyond JAX; `rich` is imported when a table is drawn.
"""

from __future__ import annotations

from typing import Any

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


__all__ = [
    "KINDS", "SLICED", "Collective", "SummaryRow", "collectives", "collective_summary", "memory_bound_bytes",
    "collective_table", "total_bytes", "Estimate", "estimate", "MemoryReport", "memory", "memory_table", "report",
    "ScheduledCollective", "ScheduleSummary", "schedule", "schedule_summary", "schedule_table", "matmul_flops",
]
