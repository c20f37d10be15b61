"""Inventory of the collectives in a compiled program, read from its HLO module.

`collectives(compiled)` lists every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute (synchronous or `-start`/`-done` async) with its
per-device bytes, how many times it runs per call (loop trip counts multiplied in)
and its replica groups; `collective_summary` totals them by kind and group.

Bytes are per device and per execution, counted on the *large* side of the
operation: the operand of an all-reduce, all-to-all or collective-permute, the
result of an all-gather, the operand of a reduce-scatter. So an all-reduce of `X`
bytes and the all-gather plus reduce-scatter that replace it under sequence
parallelism both total `X`.

**The CPU trap.** XLA's CPU backend has no reduce-scatter: where the SPMD
partitioner wants one (FSDP gradients), CPU compiles an all-reduce of the whole
array followed by a `dynamic-slice` that keeps this device's part. GPU and TPU
emit a real `reduce-scatter`. The inventory recognises an all-reduce whose every
use is a slice of `1/group` of it and reports it as kind `"all-reduce+slice"`,
counted under `reduce-scatter` in the summary (`as_reduce_scatter=True`).

The program is read through `eqgpt.profile.hlo` (its HLO module proto, or HLO text).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eqgpt.profile.hlo import KINDS, PASS_THROUGH, Module, array_text, groups_text, module_of, nbytes
from eqgpt.profile.text import human_bytes, table_text

SLICED = "all-reduce+slice"


# ------------------------------------------------------------------ analysis (shared)


def _multiplicities(module: Module) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per call; computations in loops of unknown trip count."""
    comps, entry = module.comps, module.entry
    mult: dict[str, int] = {}
    unknown: set[str] = set()
    if entry is None:
        return {c: 1 for c in comps}, unknown

    def visit(comp: str, times: int, in_unknown: bool):
        mult[comp] = mult.get(comp, 0) + times
        if in_unknown:
            unknown.add(comp)
        for ins in comps.get(comp, []):
            if ins.opcode not in ("while", "call", "conditional", "async-start"):
                continue  # fusions, reducers and sort comparators hold no collectives
            for role, callee in ins.called:
                if callee not in comps:
                    continue
                if ins.opcode == "while" and role == "body":
                    n = ins.trip_count
                    visit(callee, times * (n or 1), in_unknown or n is None)
                elif ins.opcode == "while":
                    continue  # the condition
                else:
                    visit(callee, times, in_unknown)

    visit(entry, 1, False)
    return mult, unknown

def mesh_axes_of(groups: Sequence[Sequence[int]], mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes along which the members of `groups` differ (partition id = flat mesh index)."""
    if not groups:
        return None
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if max(max(g) for g in groups) >= math.prod(sizes):
        return None
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.array(g), sizes))  # [axes, members]
        varying |= {names[i] for i in range(len(names)) if len(set(coords[i].tolist())) > 1}
    return tuple(n for n in names if n in varying)


@dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (one row of the inventory).

    **Fields:**

    - `kind`: one of `KINDS`, or `"all-reduce+slice"` (CPU's stand-in for a reduce-scatter).
    - `name`, `computation`: the HLO instruction and the computation holding it.
    - `shapes`: the arrays it moves (`"f32[32,128]"`, large side).
    - `bytes`: per device, per execution (large side: see module docs).
    - `executions`: times it runs per call of the program (loop trip counts).
    - `group_size`, `replica_groups`: devices per group, and the groups written out,
      sorted (`"{{0,4},{1,5}}"`; `"pairs{{0,1},...}"` for a permute), whatever
      notation the compiler printed them in.
    - `axes`: the mesh axes its groups span (when `collectives` was given the mesh).
    - `phase`: `"backward"` if JAX named it from a transposed (VJP) op, else `"forward"`.
    - `is_async`: compiled as a `-start`/`-done` pair.
    """

    kind: str
    name: str
    computation: str
    shapes: tuple[str, ...]
    bytes: int
    executions: int
    group_size: int
    replica_groups: str
    phase: str
    axes: tuple[str, ...] | None = None
    is_async: bool = False
    trip_count_known: bool = True

    @property
    def total_bytes(self) -> int:
        """Bytes over all executions in one call."""
        return self.bytes * self.executions

    @property
    def effective_kind(self) -> str:
        """`kind`, with `"all-reduce+slice"` reported as the `"reduce-scatter"` it stands for."""
        return "reduce-scatter" if self.kind == SLICED else self.kind




def _slice_uses(
    module: Module, comp: str, name: str, elems: int, group: int, index: int | None, depth: int = 0,
) -> bool | None:
    """Whether every use of `name` (tuple element `index`) is a 1/`group` slice.

    **Returns:** True (all uses slice), False (some use needs the whole), None (no uses).
    """
    comps = module.comps
    if depth > 8:
        return False
    verdicts = []
    for ins in comps[comp]:
        if name not in ins.operands:
            continue
        if ins.opcode == "get-tuple-element":
            if index is not None and ins.index is not None and ins.index != index:
                continue
            verdicts.append(_slice_uses(module, comp, ins.name, elems, group, None, depth + 1))
        elif index is not None:
            verdicts.append(False)  # the whole tuple used otherwise
        elif ins.opcode in ("dynamic-slice", "slice"):
            out = ins.arrays
            ok = ins.operands[0] == name and len(out) == 1 and math.prod(out[0][1]) * group == elems
            verdicts.append(ok)
        elif ins.opcode in PASS_THROUGH:
            verdicts.append(_slice_uses(module, comp, ins.name, elems, group, None, depth + 1))
        elif ins.opcode == "fusion":
            callee = next((c for r, c in ins.called if r == "calls"), None)
            if callee is None or callee not in comps:
                verdicts.append(False)
                continue
            for pos, op in enumerate(ins.operands):
                if op != name:
                    continue
                param = next((p.name for p in comps[callee] if p.opcode == "parameter" and p.param == pos), None)
                verdicts.append(False if param is None else
                                _slice_uses(module, callee, param, elems, group, None, depth + 1))
        else:
            verdicts.append(False)
    verdicts = [v for v in verdicts if v is not None]
    if not verdicts:
        return None
    return all(verdicts)


def collectives(compiled: Any, mesh: Any = None) -> list[Collective]:
    """Every collective of a compiled program.

    **Arguments:**

    - `compiled`: `jax.jit(f).lower(...).compile()`, an
      `eqx.filter_jit(f).lower(...).compile()`, or HLO text.
    - `mesh`: the `jax.sharding.Mesh` the program was compiled for, to name the
      mesh axes each collective spans (`Collective.axes`).

    **Returns:** a list of `Collective` rows in program order. Async pairs are
    one row (the `-start`); an all-reduce whose parts are each only sliced is
    reported as `"all-reduce+slice"` (see module docs). A compiled program is
    read from its HLO module proto (see module docs), text as given.
    """
    return module_collectives(module_of(compiled), mesh)


def module_collectives(module: Module, mesh: Any = None) -> list[Collective]:
    """The rows of `collectives` from a parsed module."""
    comps = module.comps
    mult, unknown = _multiplicities(module)
    rows: list[Collective] = []
    for comp, instrs in comps.items():
        if comp not in mult:
            continue
        table = {i.name: i for i in instrs}
        for ins in instrs:
            op = ins.opcode
            is_async = op.endswith("-start")
            base = op[: -len("-start")] if is_async else op
            groups, pairs = ins.groups, ins.pairs
            if base == "async":  # async-start wrapping a computation: look at what it runs
                callee = next((c for r, c in ins.called if r == "calls"), None)
                root_name = module.roots.get(callee) if callee else None
                root = next((i for i in comps.get(callee, []) if i.name == root_name), None)
                if root is not None:
                    base, groups, pairs = root.opcode, root.groups, root.pairs
                is_async = True
            if base not in KINDS:
                continue
            group = 2 if base == "collective-permute" and groups else max((len(g) for g in groups), default=1)
            axes = mesh_axes_of(groups, dict(mesh.shape)) if mesh is not None else None
            operands = [a for o in ins.operands if o in table for a in table[o].arrays]
            result = list(ins.arrays)
            if base == "all-gather":
                moved = result[len(result) - max(1, len(operands)):] if is_async else result
            elif base == "reduce-scatter":
                moved = operands or [(d, (math.prod(s) * group,)) for d, s in result]
            else:
                moved = operands or result
            phase = "backward" if "transpose(" in ins.op_name else "forward"
            common = dict(name=ins.name, computation=comp, executions=mult[comp], group_size=group,
                          replica_groups=groups_text(groups, pairs), axes=axes, phase=phase,
                          is_async=is_async, trip_count_known=comp not in unknown)
            if base == "all-reduce" and group > 1:
                sliced = [
                    _slice_uses(module, comp, ins.name, math.prod(a[1]), group, i if ins.is_tuple else None)
                    for i, a in enumerate(moved)
                ]
                parts = {
                    SLICED: [a for a, s in zip(moved, sliced, strict=True) if s],
                    "all-reduce": [a for a, s in zip(moved, sliced, strict=True) if not s],
                }
                for kind, arrs in parts.items():
                    if arrs:
                        rows.append(Collective(kind=kind, shapes=tuple(map(array_text, arrs)),
                                               bytes=sum(map(nbytes, arrs)), **common))
                continue
            rows.append(Collective(kind=base, shapes=tuple(map(array_text, moved)),
                                   bytes=sum(map(nbytes, moved)), **common))
    return rows

@dataclass(frozen=True)
class SummaryRow:
    """Collectives of one kind over one set of devices, totalled over one call of the program."""

    kind: str
    axes: tuple[str, ...] | None
    group_size: int
    ops: int
    executions: int
    bytes: int
    replica_groups: str
    phase: str | None = None


def collective_summary(
    rows: Sequence[Collective] | Any, *, mesh: Any = None, as_reduce_scatter: bool = False,
    phase: str | None = None, by_phase: bool = False,
) -> list[SummaryRow]:
    """Total `rows` (or the collectives of a compiled program) by kind and device group.

    **Arguments:**

    - `rows`: from `collectives`, or anything `collectives` accepts (then `mesh`
      names the axes).
    - `as_reduce_scatter`: count `"all-reduce+slice"` under `"reduce-scatter"`
      (what GPU/TPU would emit); by default it keeps its own row.
    - `phase`: only `"forward"` or `"backward"` rows, or all (`None`).
    - `by_phase`: a separate row per phase (forward first).

    **Returns:** one `SummaryRow` per (kind, mesh axes, group size[, phase]), in a fixed order.
    """
    if not (isinstance(rows, list | tuple) and all(isinstance(r, Collective) for r in rows)):
        rows = collectives(rows, mesh)
    if phase is not None:
        rows = [r for r in rows if r.phase == phase]
    order = {k: i for i, k in enumerate((*KINDS, SLICED))}

    def key(r):
        p = (r.phase != "forward") if by_phase else False
        return (p, r.effective_kind if as_reduce_scatter else r.kind, r.axes or (), r.group_size)

    out = []
    for (p, kind, axes, group), grp in itertools.groupby(
        sorted(rows, key=lambda r: (key(r)[0], order[key(r)[1]], key(r)[2:])), key=key
    ):
        grp = list(grp)
        out.append(SummaryRow(kind, axes or None, group, len(grp), sum(r.executions for r in grp),
                              sum(r.total_bytes for r in grp),
                              "; ".join(sorted({r.replica_groups for r in grp})),
                              ("backward" if p else "forward") if by_phase else None))
    return out


def total_bytes(rows: Sequence[Collective], kind: str, *, phase: str | None = None, min_group: int = 2) -> int:
    """Bytes of all `rows` of `kind` (matched on `kind` or `effective_kind`) per call."""
    return sum(
        r.total_bytes for r in rows
        if (r.kind == kind or r.effective_kind == kind) and (phase is None or r.phase == phase)
        and r.group_size >= min_group
    )


def collective_table(
    compiled: Any, *, mesh: Any = None, by_phase: bool = False,
    title: str = "collectives per call (per device)",
) -> str:
    """A printable table (rich) of `collective_summary`; CPU all-reduce+slice rows are labelled.

    With `mesh`, the groups are named by mesh axes; without, HLO's replica groups are
    shown. `by_phase` splits forward and backward rows (JAX's op names say which).
    """
    from rich.table import Table

    rows = collective_summary(compiled, mesh=mesh, by_phase=by_phase)
    table = Table(title=title)
    named = mesh is not None
    if by_phase:
        table.add_column("phase", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("mesh axes" if named else "replica groups", overflow="fold", max_width=40)
    for col in ("group", "ops", "runs", "bytes"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        kind = f"{r.kind} (reduce-scatter on GPU/TPU)" if r.kind == SLICED else r.kind
        where = ",".join(r.axes or ("?",)) if named else r.replica_groups
        cells = [kind, where, str(r.group_size), str(r.ops), str(r.executions), f"{r.bytes} ({human_bytes(r.bytes)})"]
        table.add_row(*([r.phase] if by_phase else []), *cells)
    if not rows:
        table.add_row(*([""] if by_phase else []), "(none)", "", "", "", "", "")
    return table_text(table, width=160)


__all__ = [
    "KINDS", "SLICED", "Collective", "SummaryRow", "collectives", "collective_summary",
    "collective_table", "total_bytes",
]
