"""Inventory of the collectives in a compiled program, read from its HLO text.

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
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eqgpt.profile.text import table_text

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SLICED = "all-reduce+slice"

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")
_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "convert"}


@dataclass(frozen=True)
class _Instr:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str


def _split_top(s: str) -> list[str]:
    """Split on commas not nested in (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return out


def _matching(s: str, start: int) -> int:
    """Index just past the bracket group opening at `s[start]`."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(_COMMENT.sub("", line))
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _matching(rest, 0)
        type_, rest = rest[:end], rest[end:].lstrip()
    else:
        type_, _, rest = rest.partition(" ")
    op_match = re.match(r"([a-z][a-z0-9\-_.]*)\(", rest)
    if not op_match:
        return None
    opcode = op_match.group(1)
    end = _matching(rest, op_match.end() - 1)
    operands = tuple(
        o.strip().split()[-1].lstrip("%") for o in _split_top(rest[op_match.end(): end - 1]) if o.strip()
    )
    return _Instr(name, type_, opcode, operands, rest[end:])


def _parse(hlo: str) -> tuple[dict[str, list[_Instr]], str | None]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = _parse_instr(line)
            if ins is not None:
                comps[current].append(ins)
    return comps, entry


def _arrays(type_: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_)
            if d in _DTYPE_BYTES or d.startswith("f8")]


def _nbytes(arr: tuple[str, tuple[int, ...]]) -> int:
    dtype, dims = arr
    return _DTYPE_BYTES.get(dtype, 1) * math.prod(dims)


def _fmt(arr: tuple[str, tuple[int, ...]]) -> str:
    return f"{arr[0]}[{','.join(map(str, arr[1]))}]"


def _called(ins: _Instr) -> list[tuple[str, str]]:
    """(role, computation) pairs that `ins` calls."""
    out = []
    for role in ("body", "condition", "calls", "to_apply", "true_computation", "false_computation"):
        for m in re.finditer(rf"\b{role}=%([^\s,}}]+)", ins.attrs):
            out.append((role, m.group(1)))
    m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
    if m:
        out += [("branch", c.strip().lstrip("%")) for c in m.group(1).split(",") if c.strip()]
    return out


def _trip_count(ins: _Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    return int(m.group(1)) if m else None


def _multiplicities(comps: dict[str, list[_Instr]], entry: str | None) -> tuple[dict[str, int], set[str]]:
    """How many times each computation runs per call; computations in loops of unknown trip count."""
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
            for role, callee in _called(ins):
                if callee not in comps:
                    continue
                if ins.opcode == "while" and role == "body":
                    n = _trip_count(ins)
                    visit(callee, times * (n or 1), in_unknown or n is None)
                elif ins.opcode == "while":
                    continue  # the condition
                else:
                    visit(callee, times, in_unknown)

    visit(entry, 1, False)
    return mult, unknown


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))?\s*\{([^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in (text or "").split(",") if x.strip()]


def _iota(dims: list[int], perm: list[int]) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).ravel()


def _groups(attrs: str) -> tuple[list[list[int]], str]:
    """Explicit device groups of a collective (partition ids), and the text HLO wrote."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        pairs = [p.split("=") for p in m.group(1).split(",") if p.strip()]
        names = [k.strip().strip("'") for k, _ in pairs]
        sizes = [int(v) for _, v in pairs]
        ids = _iota(_ints(m.group(2)), _ints(m.group(3))) if m.group(2) else np.arange(math.prod(sizes))
        grouped = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
        rest = [i for i in range(len(sizes)) if i not in grouped]
        size = math.prod(sizes[i] for i in grouped)
        groups = ids.reshape(sizes).transpose(rest + grouped).reshape(-1, size).tolist()
        return groups, m.group(0)[len("replica_groups="):]
    m = _IOTA_GROUPS.search(attrs)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)))
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist(), m.group(0)[len("replica_groups="):]
    m = _LIST_GROUPS.search(attrs)
    if m:
        groups = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return [g for g in groups if g], "{" + m.group(1) + "}"
    m = _PAIRS.search(attrs)
    if m:
        pairs = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
        return [p for p in pairs if len(p) == 2 and p[0] != p[1]], "pairs{" + m.group(1) + "}"
    return [], ""


def mesh_axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
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
    - `group_size`, `replica_groups`: devices per group, and the groups as HLO writes them.
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


def _hlo_text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    inner = getattr(compiled, "compiled", None)  # equinox's Compiled wraps jax's
    if inner is not None and hasattr(inner, "as_text"):
        compiled = inner
    if not hasattr(compiled, "as_text"):
        raise ValueError(
            f"collectives() needs a compiled program (jax.jit(f).lower(...).compile()) or its HLO "
            f"text; got {type(compiled).__name__}."
        )
    text = compiled.as_text()
    if not isinstance(text, str):
        raise ValueError("this compiled object has no HLO text (as_text() returned None).")
    return text


def _slice_uses(comps, comp: str, name: str, elems: int, group: int, index: int | None, depth: int = 0) -> bool | None:
    """Whether every use of `name` (tuple element `index`) is a 1/`group` slice.

    **Returns:** True (all uses slice), False (some use needs the whole), None (no uses).
    """
    if depth > 8:
        return False
    verdicts = []
    for ins in comps[comp]:
        if name not in ins.operands:
            continue
        if ins.opcode == "get-tuple-element":
            m = re.search(r"index=(\d+)", ins.attrs)
            if index is not None and m and int(m.group(1)) != index:
                continue
            verdicts.append(_slice_uses(comps, comp, ins.name, elems, group, None, depth + 1))
        elif index is not None:
            verdicts.append(False)  # the whole tuple used otherwise
        elif ins.opcode in ("dynamic-slice", "slice"):
            out = _arrays(ins.type)
            ok = ins.operands[0] == name and len(out) == 1 and math.prod(out[0][1]) * group == elems
            verdicts.append(ok)
        elif ins.opcode in _PASS_THROUGH:
            verdicts.append(_slice_uses(comps, comp, ins.name, elems, group, None, depth + 1))
        elif ins.opcode == "fusion":
            callee = next((c for r, c in _called(ins) if r == "calls"), None)
            if callee is None or callee not in comps:
                verdicts.append(False)
                continue
            for pos, op in enumerate(ins.operands):
                if op != name:
                    continue
                param = next((p.name for p in comps[callee]
                              if p.opcode == "parameter" and p.operands == (str(pos),)), None)
                verdicts.append(False if param is None else
                                _slice_uses(comps, callee, param, elems, group, None, depth + 1))
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
    reported as `"all-reduce+slice"` (see module docs).
    """
    comps, entry = _parse(_hlo_text(compiled))
    mult, unknown = _multiplicities(comps, entry)
    rows: list[Collective] = []
    for comp, instrs in comps.items():
        if comp not in mult:
            continue
        table = {i.name: i for i in instrs}
        for ins in instrs:
            op = ins.opcode
            is_async = op.endswith("-start")
            base = op[: -len("-start")] if is_async else op
            if base == "async":  # async-start wrapping a computation: look at what it runs
                callee = next((c for r, c in _called(ins) if r == "calls"), None)
                root = comps.get(callee, [None])[-1] if callee else None
                base = root.opcode if root is not None else base
                is_async = True
            if base not in KINDS:
                continue
            groups, groups_text = _groups(ins.attrs)
            group = 2 if base == "collective-permute" and groups else max((len(g) for g in groups), default=1)
            axes = mesh_axes_of(groups, dict(mesh.shape)) if mesh is not None else None
            operands = [a for o in ins.operands if o in table for a in _arrays(table[o].type)]
            result = _arrays(ins.type)
            if base == "all-gather":
                moved = result[len(result) - max(1, len(operands)):] if is_async else result
            elif base == "reduce-scatter":
                moved = operands or [(d, (math.prod(s) * group,)) for d, s in result]
            else:
                moved = operands or result
            meta = re.search(r'op_name="([^"]*)"', ins.attrs)
            phase = "backward" if meta and "transpose(" in meta.group(1) else "forward"
            common = dict(name=ins.name, computation=comp, executions=mult[comp], group_size=group,
                          replica_groups=groups_text, axes=axes, phase=phase, is_async=is_async,
                          trip_count_known=comp not in unknown)
            if base == "all-reduce" and group > 1:
                tuple_result = ins.type.startswith("(")
                sliced = [
                    _slice_uses(comps, comp, ins.name, math.prod(a[1]), group, i if tuple_result else None)
                    for i, a in enumerate(moved)
                ]
                parts = {
                    SLICED: [a for a, s in zip(moved, sliced, strict=True) if s],
                    "all-reduce": [a for a, s in zip(moved, sliced, strict=True) if not s],
                }
                for kind, arrs in parts.items():
                    if arrs:
                        rows.append(Collective(kind=kind, shapes=tuple(map(_fmt, arrs)),
                                               bytes=sum(map(_nbytes, arrs)), **common))
                continue
            rows.append(Collective(kind=base, shapes=tuple(map(_fmt, moved)),
                                   bytes=sum(map(_nbytes, moved)), **common))
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


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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
        cells = [kind, where, str(r.group_size), str(r.ops), str(r.executions), f"{r.bytes} ({_human(r.bytes)})"]
        table.add_row(*([r.phase] if by_phase else []), *cells)
    if not rows:
        table.add_row(*([""] if by_phase else []), "(none)", "", "", "", "", "")
    return table_text(table, width=160)


__all__ = [
    "KINDS", "SLICED", "Collective", "SummaryRow", "collectives", "collective_summary",
    "collective_table", "total_bytes",
]
