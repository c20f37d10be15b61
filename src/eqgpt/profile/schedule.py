"""The schedule report: which collectives of a compiled program can hide behind compute.

A compiled module is *scheduled*: its HLO text lists each computation's
instructions in the order they run. `schedule(compiled)` reads that text (with the
parser of `eqgpt.profile.collectives`, so it lists exactly the inventory's
collectives and bytes) and tells, for each collective:

- `is_async`: compiled as a `-start`/`-done` pair, so compute can run in between;
- `overlap_flops`: matmul FLOPs of the instructions scheduled between its start
  and its done (0 for a synchronous collective): the compute it does overlap;
- `independent_flops`: matmul FLOPs in the same computation that neither feed it
  nor use its result: the compute a latency-hiding scheduler *could* put beside it.

FLOPs are those of `dot`s, `2 x (result elements) x (contracted size)`, including
dots inside fusions and called computations and loop bodies (times their trip
count); elementwise work counts 0. Figures are per execution of the collective,
bytes as the inventory counts them (per device, large side).

Bytes are *exposed* unless compute is scheduled beside them; *overlappable* where
independent compute exists. With a link `bandwidth` (bytes/s) and a `peak`
(FLOP/s), a collective is *hidden* when `bytes / bandwidth <= overlap_flops / peak`.
XLA's CPU backend runs every collective synchronously, so on CPU everything is
exposed and the report shows the structure (how much could overlap); a GPU with
`eqgpt.parallel.overlap`'s flags compiles them asynchronously.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eqgpt.profile.collectives import Collective, module_collectives
from eqgpt.profile.hlo import Instr, Module, is_collective, module_from_text, nbytes
from eqgpt.profile.text import human_bytes, table_text


@dataclass(frozen=True)
class ScheduledCollective:
    """One collective with its place in the schedule.

    **Fields:** `collective` (the inventory's row), `overlap_flops` and
    `independent_flops` (per execution; see module docs).
    """

    collective: Collective
    overlap_flops: int
    independent_flops: int

    @property
    def is_async(self) -> bool:
        """Whether it is compiled as a `-start`/`-done` pair."""
        return self.collective.is_async

    def hidden(self, bandwidth: float | None = None, peak: float | None = None) -> bool:
        """Whether compute is scheduled beside it; with `bandwidth` (bytes/s) and `peak` (FLOP/s),
        whether that compute lasts at least as long as the transfer."""
        if not (self.is_async and self.overlap_flops > 0):
            return False
        return bandwidth is None or peak is None or self.collective.bytes / bandwidth <= self.overlap_flops / peak

    def could_hide(self, bandwidth: float | None = None, peak: float | None = None) -> bool:
        """Whether independent compute exists beside it (with `bandwidth` and `peak`: enough of it,
        `bytes / bandwidth <= independent_flops / peak`), so an asynchronous schedule could hide it."""
        flops = max(self.independent_flops, self.overlap_flops)
        if flops == 0:
            return False
        return bandwidth is None or peak is None or self.collective.bytes / bandwidth <= flops / peak


@dataclass(frozen=True)
class ScheduleSummary:
    """Communication bytes of one call (step), per device: `total`, `overlapped` (compute
    scheduled beside them: `hidden`), `exposed` (`total - overlapped`), `overlappable`
    (`could_hide`), `async_bytes`."""

    total: int
    overlapped: int
    exposed: int
    overlappable: int
    async_bytes: int

    @property
    def overlappable_share(self) -> float:
        """`overlappable / total` (0 without communication)."""
        return self.overlappable / self.total if self.total else 0.0


def _text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    inner = getattr(compiled, "compiled", None)  # equinox's Compiled wraps jax's
    text = (inner if inner is not None and hasattr(inner, "as_text") else compiled).as_text()
    if not isinstance(text, str):
        raise ValueError(f"schedule() needs a compiled program or its HLO text; got {type(compiled).__name__}.")
    return text


class _Flops:
    """Matmul FLOPs of instructions and computations of one module (memoised)."""

    def __init__(self, module: Module):
        self.module = module
        self.tables = {c: {i.name: i for i in instrs} for c, instrs in module.comps.items()}

    def of(self, comp: str, ins: Instr) -> int:
        if ins.opcode == "dot" and ins.arrays and ins.operands:
            lhs = self.tables[comp].get(ins.operands[0])
            if lhs is None or not lhs.arrays:
                return 0
            contracted = math.prod(lhs.arrays[0][1][d] for d in ins.contracting)
            return 2 * math.prod(ins.arrays[0][1]) * contracted
        if ins.opcode == "convolution" and ins.conv is not None and ins.arrays and len(ins.operands) > 1:
            return self._convolution(comp, ins)
        called = [self.computation(c) for role, c in ins.called if c in self.module.comps and role != "condition"]
        if ins.opcode == "conditional":  # one branch runs: the costliest bounds it
            return max(called, default=0)
        return ((ins.trip_count or 1) if ins.opcode == "while" else 1) * sum(called)

    def _convolution(self, comp: str, ins: Instr) -> int:
        """TPU compiles matmuls as convolutions, some with spatial dimensions that stand for batch
        dimensions (a window over padding): each output element sums over the kernel's input features
        and, along each spatial dimension, over the window taps that meet real input (stride 1)."""
        lhs, rhs = (self.tables[comp].get(o) for o in ins.operands[:2])
        if lhs is None or rhs is None or not lhs.arrays or not rhs.arrays:
            return 0
        lhs_labels, rhs_labels, out_labels, window = ins.conv
        lhs_shape, kernel, out = lhs.arrays[0][1], rhs.arrays[0][1], ins.arrays[0][1]
        if len(lhs_labels) != len(lhs_shape) or len(rhs_labels) != len(kernel) or len(out_labels) != len(out):
            return 0
        flops = 2 * math.prod(out) * kernel[rhs_labels.index("i")]
        for k, taps in enumerate(window):
            d = str(k)
            size, out_size = lhs_shape[lhs_labels.index(d)], out[out_labels.index(d)]
            flops = flops * min(size, out_size) * taps // max(out_size, 1)
        return flops

    @functools.cache  # noqa: B019 (one instance per report)
    def computation(self, comp: str) -> int:
        return sum(self.of(comp, i) for i in self.module.comps[comp])


# Instructions that move no data through HBM themselves (or whose cost is counted elsewhere: a custom call is a
# Pallas kernel, timed as attention; collectives are communication; loops and calls count their bodies).
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
             "replica-id", "opt-barrier", "custom-call", "iota"}
_SLICES = {"dynamic-slice", "slice", "gather"}


def _bytes(ins: Instr | None) -> int:
    """Bytes of an instruction's result in device memory (HBM): arrays placed on chip (VMEM) move none."""
    if ins is None:
        return 0
    spaces = ins.spaces if len(ins.spaces) == len(ins.arrays) else (0,) * len(ins.arrays)
    return sum(nbytes(a) for a, space in zip(ins.arrays, spaces, strict=True) if space == 0)


class _Bytes:
    """HBM bytes of the memory-bound instructions of one module (memoised): every instruction outside
    fusions that neither is nor holds a matmul, reading its operands and writing its result once."""

    def __init__(self, module: Module, flops: _Flops):
        self.module, self.flops = module, flops

    @functools.cache  # noqa: B019 (one instance per report)
    def computation(self, comp: str) -> int:
        return sum(self.of(comp, i) for i in self.module.comps[comp])

    def of(self, comp: str, ins: Instr) -> int:
        called = [self.computation(c) for role, c in ins.called if c in self.module.comps and role != "condition"]
        if ins.opcode == "while":
            return (ins.trip_count or 1) * sum(called)
        if ins.opcode in ("call", "conditional"):
            return max(called, default=0) if ins.opcode == "conditional" else sum(called)
        if (ins.opcode in _NO_BYTES or is_collective(ins.opcode) or ins.opcode.endswith(("-start", "-done"))
                or self.flops.of(comp, ins) > 0):
            return 0
        table = self.flops.tables[comp]
        if ins.opcode == "fusion":
            return self._fusion(comp, ins)
        if ins.opcode == "dynamic-update-slice":  # in place: read and write the update
            return 2 * _bytes(table.get(ins.operands[1])) if len(ins.operands) > 1 else 0
        if ins.opcode in _SLICES:
            return 2 * _bytes(ins)
        return _bytes(ins) + sum(_bytes(table.get(o)) for o in ins.operands)

    def _fusion(self, comp: str, ins: Instr) -> int:
        """A fusion reads each operand once, except one it only slices (the slice) or updates in place (nothing),
        and writes its result (an in-place update: the update)."""
        fused = next((c for role, c in ins.called if role == "calls" and c in self.module.comps), None)
        if fused is None:
            return _bytes(ins) + sum(_bytes(self.flops.tables[comp].get(o)) for o in ins.operands)
        instrs, table = self.module.comps[fused], self.flops.tables[fused]
        users: dict[str, list[Instr]] = {}
        for i in instrs:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        read = 0
        for p in instrs:
            if p.opcode != "parameter" or p.param is None or p.param >= len(ins.operands):
                continue
            us = users.get(p.name, [])
            if us and all(u.opcode in _SLICES and u.operands[0] == p.name for u in us):
                read += sum(_bytes(u) for u in us)
            elif not (us and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p.name for u in us)):
                read += _bytes(self.flops.tables[comp].get(ins.operands[p.param]))
        root = table.get(self.module.roots.get(fused, ""))
        outs = [table.get(o) for o in root.operands] if root is not None and root.opcode == "tuple" else [root]
        write = sum(_bytes(table.get(o.operands[1])) if o is not None and o.opcode == "dynamic-update-slice"
                    and len(o.operands) > 1 else _bytes(o) for o in outs)
        return read + write


def memory_bound_bytes(compiled: Any) -> int:
    """HBM bytes per device of one call's memory-bound work: every instruction outside matmuls, Pallas
    kernels and collectives (elementwise fusions, reductions, copies, the optimizer update), each reading
    its operands and writing its result once (a sliced operand: the slice; an in-place update: the update),
    loop bodies times their trip counts; arrays the compiler placed on chip (a TPU's VMEM, `S(1)` in their
    layout) move none. An estimate of traffic, not of time."""
    module = module_from_text(_text(compiled))
    return _Bytes(module, _Flops(module)).computation(module.entry) if module.entry else 0


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _place(module: Module, flops: _Flops, row: Collective) -> ScheduledCollective:
    instrs = module.comps[row.computation]
    names = [i.name for i in instrs]
    start = names.index(row.name)
    done = start
    if row.is_async:
        done = next((k for k in range(start + 1, len(instrs))
                     if instrs[k].opcode.endswith("-done") and row.name in instrs[k].operands), start)
    between = sum(flops.of(row.computation, i) for i in instrs[start + 1: done])
    operands = {i.name: list(i.operands) for i in instrs}
    users: dict[str, list[str]] = {}
    for i in instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i.name)
    related = _closure(names[start], operands) | _closure(names[done], users) | {names[start], names[done]}
    independent = sum(flops.of(row.computation, i) for i in instrs if i.name not in related)
    return ScheduledCollective(row, between, independent)


def schedule(compiled: Any, mesh: Any = None) -> list[ScheduledCollective]:
    """Each collective of a compiled program with the compute it overlaps and could overlap.

    **Arguments:** `compiled` (`jax.jit(f).lower(...).compile()`, equinox's equivalent,
    or scheduled HLO text) and optionally its `mesh` (to name each collective's axes).

    **Returns:** one `ScheduledCollective` per row of `eqgpt.profile.collectives`
    (an all-reduce whose parts split into `all-reduce` and `all-reduce+slice` rows
    gives two), in program order.
    """
    module = module_from_text(_text(compiled))
    flops = _Flops(module)
    return [_place(module, flops, row) for row in module_collectives(module, mesh)]


def matmul_flops(compiled: Any) -> int:
    """Matmul FLOPs of one call of a compiled program, per device: its `dot`s and convolutions (TPU
    compiles matmuls as convolutions), inside fusions, calls and loops (times their trip counts).
    Unlike XLA's `cost_analysis()`, a loop body counts once per iteration; a custom call (a Pallas
    kernel) counts 0."""
    module = module_from_text(_text(compiled))
    return _Flops(module).computation(module.entry) if module.entry else 0


def schedule_summary(rows: Sequence[ScheduledCollective], *, bandwidth: float | None = None,
                     peak: float | None = None) -> ScheduleSummary:
    """Totals of one call over `rows` (from `schedule`); `bandwidth` and `peak` as `hidden`."""
    total = sum(r.collective.total_bytes for r in rows)
    overlapped = sum(r.collective.total_bytes for r in rows if r.hidden(bandwidth, peak))
    return ScheduleSummary(
        total=total, overlapped=overlapped, exposed=total - overlapped,
        overlappable=sum(r.collective.total_bytes for r in rows if r.could_hide(bandwidth, peak)),
        async_bytes=sum(r.collective.total_bytes for r in rows if r.is_async))


def schedule_table(compiled: Any, *, mesh: Any = None, bandwidth: float | None = None, peak: float | None = None,
                   title: str = "communication per step (per device): exposed vs overlappable") -> str:
    """A printable table of `schedule`: per kind and phase, bytes per step that are async,
    overlapped by scheduled compute, exposed, and overlappable; a total row."""
    from rich.table import Table

    rows = schedule(compiled, mesh)
    groups: dict[tuple[str, str], list[ScheduledCollective]] = {}
    for r in rows:
        groups.setdefault((r.collective.phase, r.collective.effective_kind), []).append(r)
    table = Table(title=title)
    for col in ("phase", "kind"):
        table.add_column(col, no_wrap=True)
    for col in ("ops", "bytes", "async", "overlapped", "exposed", "overlappable", "overlap GFLOP"):
        table.add_column(col, justify="right", no_wrap=True)

    def add(label: tuple[str, str], part: list[ScheduledCollective]) -> None:
        s = schedule_summary(part, bandwidth=bandwidth, peak=peak)
        gflop = sum(r.overlap_flops * r.collective.executions for r in part) / 1e9
        table.add_row(*label, str(len(part)), *(human_bytes(b) for b in (s.total, s.async_bytes, s.overlapped,
                                                                         s.exposed, s.overlappable)), f"{gflop:.3f}")

    for key in sorted(groups):
        add(key, groups[key])
    add(("all", ""), rows)
    return table_text(table, width=160)


__all__ = [
    "ScheduledCollective", "ScheduleSummary", "schedule", "schedule_summary", "schedule_table", "memory_bound_bytes"]
