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

**Where it reads from.** A compiled program is read from its optimized HLO
module *proto* (`runtime_executable().hlo_modules()[0]`, serialized), decoded
here with the handful of `xla/service/hlo.proto` fields the inventory needs
(field numbers are the proto's stable contract; no `protobuf` dependency).
XLA's text printer is not a contract: jax 0.10 prints mesh-axis replica groups
over synthetic axes (`mesh['axis_0'=2,...], device_ids=([2,2,2]T(2,1,0)) {'axis_1'}`),
jax 0.12 over the named mesh with sub-axes (`{'pipeline':(1)2}`). Both carry the
same `MeshAxesReplicaGroupListProto`, which is expanded to explicit device groups
here, so the two versions give the same inventory. HLO *text* (a `str`) is
still accepted, for hand-written modules and dumps, and parsed with the same
expansion rules; `Collective.replica_groups` is always the explicit groups.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
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
    "s2": 1, "u2": 1, "s1": 1, "u1": 1,
}
# xla_data.proto's PrimitiveType numbers (arrays only; token, tuple, opaque are not data).
_PRIMITIVE = {
    1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32", 9: "u64",
    10: "f16", 11: "f32", 12: "f64", 15: "c64", 16: "bf16", 18: "c128", 19: "f8e5m2",
    20: "f8e4m3fn", 21: "s4", 22: "u4", 23: "f8e4m3b11fnuz", 24: "f8e5m2fnuz", 25: "f8e4m3fnuz",
    26: "s2", 27: "u2", 28: "f8e4m3", 29: "f8e3m4", 30: "s1", 31: "u1", 32: "f4e2m1fn",
    33: "f8e8m0fnu", 35: "f6e3m2fn", 36: "f6e2m3fn",
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMMENT = re.compile(r"/\*.*?\*/")
_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "convert"}

Array = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class _Instr:
    """One HLO instruction, with only what the inventory reads (from proto or text alike)."""

    name: str
    opcode: str
    arrays: tuple[Array, ...]  # the leaves of the result shape
    is_tuple: bool
    operands: tuple[str, ...]
    called: tuple[tuple[str, str], ...] = ()  # (role, computation)
    trip_count: int | None = None  # of a while loop, where XLA knows it
    index: int | None = None  # of a get-tuple-element
    param: int | None = None  # of a parameter
    op_name: str = ""  # JAX's name of the op (metadata)
    groups: tuple[tuple[int, ...], ...] = ()  # device groups, or (source, target) pairs
    pairs: bool = False
    contracting: tuple[int, ...] = ()  # of a dot: the left operand's contracting dimensions
    conv: tuple[str, str, str, tuple[int, ...]] | None = None  # of a convolution (text): dim labels, window
    value: int | None = None  # of an integer scalar constant (read from text)
    direction: str = ""  # of a compare (read from text)


@dataclass(frozen=True)
class _Module:
    comps: dict[str, list[_Instr]]
    entry: str | None
    roots: dict[str, str]  # computation -> name of its root instruction


def _is_array(dtype: str) -> bool:
    return dtype in _DTYPE_BYTES or dtype.startswith(("f8", "f6", "f4"))


def _nbytes(arr: Array) -> int:
    dtype, dims = arr
    return _DTYPE_BYTES.get(dtype, 1) * math.prod(dims)


def _fmt(arr: Array) -> str:
    return f"{arr[0]}[{','.join(map(str, arr[1]))}]"


# ------------------------------------------------------------------ device groups (shared)


def _iota(dims: Sequence[int], perm: Sequence[int]) -> np.ndarray:
    """XLA's iota device list: `arange(prod(dims)).reshape(dims).transpose(perm)`, flattened."""
    ids = np.arange(math.prod(dims)).reshape(tuple(dims))
    return (ids.transpose(tuple(perm)) if len(perm) else ids).ravel()


def _mesh_groups(
    sizes: Sequence[int], ids: np.ndarray | None, axes: Sequence[tuple[int, int | None, int | None]],
) -> tuple[tuple[int, ...], ...]:
    """Expand a mesh-axes replica group list (XLA's `MeshAxesReplicaGroupList`).

    `sizes` are the mesh's axis sizes (major first) and `ids` its devices in mesh
    order (`None`: iota). `axes` are `(mesh axis, pre_size, size)`, with
    `pre_size, size` set for a sub-axis: the axis of size `N` seen as
    `[pre_size, size, N / (pre_size * size)]` (major first), of which the middle.
    A group is every device that agrees on all the other (sub-)axes.
    """
    n = math.prod(sizes)
    ids = np.arange(n) if ids is None or len(ids) == 0 else np.asarray(ids).ravel()
    cuts = [{1, s} for s in sizes]  # per axis: products of factor sizes from the major side
    for a, pre, size in axes:
        if pre is not None:
            cuts[a] |= {pre, pre * size}
    factors, where = [], {}  # where[(axis, cut)] = index into factors of the factor ending there
    for a, s in enumerate(sizes):
        c = sorted(x for x in cuts[a] if x <= s)
        for lo, hi in zip(c, c[1:], strict=False):
            where[(a, lo)] = len(factors)
            factors.append(hi // lo)
    grouped: list[int] = []
    for a, pre, size in axes:
        lo, hi = (1, sizes[a]) if pre is None else (pre, pre * size)
        c = sorted(x for x in cuts[a] if lo <= x < hi)
        grouped += [where[(a, x)] for x in c]
    rest = [i for i in range(len(factors)) if i not in grouped]
    size = math.prod(factors[i] for i in grouped)
    groups = ids.reshape(factors or [1]).transpose(rest + grouped if factors else [0]).reshape(-1, size)
    return tuple(tuple(int(x) for x in g) for g in groups)


def _groups_text(groups: tuple[tuple[int, ...], ...], pairs: bool) -> str:
    """Canonical text of device groups: members and groups sorted (pairs: pairs sorted)."""
    canon = sorted(groups) if pairs else sorted(tuple(sorted(g)) for g in groups)
    body = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in canon) + "}"
    return ("pairs" + body) if pairs else body if groups else ""


# ------------------------------------------------------------------ the HLO module proto


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = shift = 0
    while True:
        x = b[i]
        i += 1
        r |= (x & 0x7F) << shift
        shift += 7
        if x < 0x80:
            return r, i


def _fields(b: bytes) -> dict[int, list[Any]]:
    """One protobuf message: field number -> values (ints for varints, bytes otherwise)."""
    out: dict[int, list[Any]] = {}
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            length, i = _varint(b, i)
            v, i = b[i: i + length], i + length
        elif wire == 1:
            v, i = int.from_bytes(b[i: i + 8], "little"), i + 8
        elif wire == 5:
            v, i = int.from_bytes(b[i: i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {num})")
        out.setdefault(num, []).append(v)
    return out


def _ints(values: list[Any]) -> list[int]:
    """A repeated integer field, packed or not (int64 two's complement)."""
    out = []
    for v in values:
        if isinstance(v, bytes | bytearray):
            i = 0
            while i < len(v):
                x, i = _varint(v, i)
                out.append(x)
        else:
            out.append(v)
    return [x - (1 << 64) if x >= 1 << 63 else x for x in out]


def _one(msg: dict[int, list[Any]], num: int, default: Any = None) -> Any:
    vals = msg.get(num)
    return vals[-1] if vals else default


def _text(msg: dict[int, list[Any]], num: int) -> str:
    return bytes(_one(msg, num, b"")).decode("utf-8", "replace")


def _shape_arrays(shape: bytes) -> tuple[tuple[Array, ...], bool]:
    """ShapeProto (element_type 2, dimensions 3, tuple_shapes 4): its array leaves."""
    msg = _fields(shape)
    if _one(msg, 2, 0) == 13:  # TUPLE
        leaves = [a for t in msg.get(4, []) for a in _shape_arrays(t)[0]]
        return tuple(leaves), True
    dtype = _PRIMITIVE.get(_one(msg, 2, 0))
    return ((dtype, tuple(_ints(msg.get(3, [])))),) if dtype else (), False


def _proto_groups(ins: dict[int, list[Any]]) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """Device groups of a collective (HloInstructionProto fields 93, 92, 87, 49, 52)."""
    if 93 in ins:  # mesh_axes_replica_group_list: {mesh, axes}
        rg = _fields(_one(ins, 93))
        mesh = _fields(_one(rg, 1, b""))
        sizes = [_one(_fields(a), 2, 0) for a in mesh.get(1, [])]
        ids = None
        if mesh.get(2):
            ids = np.array(_ints(mesh[2]))
        elif 3 in mesh:
            it = _fields(_one(mesh, 3))
            ids = _iota(_ints(it.get(1, [])), _ints(it.get(2, [])))
        axes = []
        for ref in rg.get(2, []):
            ref = _fields(ref)
            sub = _fields(_one(ref, 2)) if 2 in ref else None
            axes.append((_one(ref, 1, 0), *((_one(sub, 1, 0), _one(sub, 2, 0)) if sub else (None, None))))
        return _mesh_groups(sizes, ids, axes), False
    if 92 in ins:  # iota_collective_device_list
        it = _fields(_one(ins, 92))
        ids = _iota(_ints(it.get(3, [])), _ints(it.get(4, [])))
        return tuple(map(tuple, ids.reshape(_one(it, 1, 0), _one(it, 2, 0)).tolist())), False
    lists = [_fields(g) for g in _fields(_one(ins, 87, b"")).get(1, [])] or [_fields(g) for g in ins.get(49, [])]
    if lists:
        return tuple(t for t in (tuple(_ints(g.get(1, []))) for g in lists) if t), False
    if 52 in ins:  # source_target_pairs
        pairs = [_fields(p) for p in ins[52]]
        pairs = [(_one(p, 1, 0), _one(p, 2, 0)) for p in pairs]
        return tuple(p for p in pairs if p[0] != p[1]), True
    return (), False


_ROLES = {"while": ("body", "condition"), "conditional": ("branch",), "fusion": ("calls",),
          "call": ("calls",), "async-start": ("calls",)}


def _module_from_proto(serialized: bytes) -> _Module:
    """HloModuleProto: computations 3, entry_computation_id 6 (name 2)."""
    mod = _fields(serialized)
    raw = [_fields(c) for c in mod.get(3, [])]
    comp_names = {_one(c, 5, 0): _text(c, 1) for c in raw}
    entry = comp_names.get(_one(mod, 6, -1)) or _text(mod, 2) or None
    comps: dict[str, list[_Instr]] = {}
    roots: dict[str, str] = {}
    for c in raw:  # HloComputationProto: name 1, instructions 2, id 5, root_id 6
        instrs = [_fields(i) for i in c.get(2, [])]
        names = {_one(i, 35, 0): _text(i, 1) for i in instrs}
        roots[_text(c, 1)] = names.get(_one(c, 6, 0), "")
        out = []
        for i in instrs:
            opcode = _text(i, 2)
            arrays, is_tuple = _shape_arrays(_one(i, 3, b""))
            callees = [comp_names.get(x, "") for x in _ints(i.get(38, []))]
            roles = _ROLES.get(opcode, ("to_apply",))
            called = tuple((roles[min(k, len(roles) - 1)], cname) for k, cname in enumerate(callees))
            trip = None
            if opcode == "while":
                m = re.search(rb'"known_trip_count":\{"n":"(\d+)"\}', bytes(_one(i, 43, b"")))
                trip = int(m.group(1)) if m else None
            groups, pairs = _proto_groups(i) if _base_kind(opcode) else ((), False)
            out.append(_Instr(
                name=_text(i, 1), opcode=opcode, arrays=arrays, is_tuple=is_tuple,
                operands=tuple(names.get(x, "") for x in _ints(i.get(36, []))), called=called,
                trip_count=trip, index=_one(i, 13, 0) if opcode == "get-tuple-element" else None,
                param=_one(i, 9, 0) if opcode == "parameter" else None,
                op_name=_text(_fields(_one(i, 7, b"")), 2), groups=groups, pairs=pairs,
                contracting=tuple(_ints(_fields(_one(i, 30, b"")).get(1, []))) if opcode == "dot" else (),
            ))
        comps[_text(c, 1)] = out
    return _Module(comps, entry, roots)


def _base_kind(opcode: str) -> bool:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base in KINDS


# ------------------------------------------------------------------ HLO text


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


def _text_arrays(type_: str) -> tuple[Array, ...]:
    return tuple((d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_)
                 if _is_array(d))


def _text_called(attrs: str) -> tuple[tuple[str, str], ...]:
    out = []
    for role in ("body", "condition", "calls", "to_apply", "true_computation", "false_computation"):
        for m in re.finditer(rf"\b{role}=%([^\s,}}]+)", attrs):
            out.append((role, m.group(1)))
    m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if m:
        out += [("branch", c.strip().lstrip("%")) for c in m.group(1).split(",") if c.strip()]
    return tuple(out)


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=(?:\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\)|\[([0-9,]*)\]))?"
    r"\s*\{([^}]*)\}"
)
_AXIS_REF = re.compile(r"'?([^',:(){}\s]+)'?(?::\((\d+)\)(\d+))?")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")


def _int_list(text: str | None) -> list[int]:
    return [int(x) for x in (text or "").split(",") if x.strip()]


def _text_groups(attrs: str) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """Device groups of a collective from its printed attributes (every notation XLA uses)."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        pairs = [p.rsplit("=", 1) for p in _split_top(m.group(1)) if p.strip()]
        names = [k.strip().strip("'") for k, _ in pairs]
        sizes = [int(v) for _, v in pairs]
        if m.group(2) is not None:
            ids = _iota(_int_list(m.group(2)), _int_list(m.group(3)))
        elif m.group(4) is not None:
            ids = np.array(_int_list(m.group(4)))
        else:
            ids = None
        axes = []
        for ref in _split_top(m.group(5)):
            r = _AXIS_REF.fullmatch(ref.strip())
            if not r:
                continue
            sub = (int(r.group(2)), int(r.group(3))) if r.group(2) else (None, None)
            axes.append((names.index(r.group(1)), *sub))
        return _mesh_groups(sizes, ids, axes), False
    m = _IOTA_GROUPS.search(attrs)
    if m:
        ids = _iota(_int_list(m.group(3)), _int_list(m.group(4)))
        return tuple(map(tuple, ids.reshape(int(m.group(1)), int(m.group(2))).tolist())), False
    m = _LIST_GROUPS.search(attrs)
    if m:
        groups = (tuple(_int_list(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
        return tuple(g for g in groups if g), False
    m = _PAIRS.search(attrs)
    if m:
        pairs = (tuple(_int_list(g)) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
        return tuple(p for p in pairs if len(p) == 2 and p[0] != p[1]), True
    return (), False


def _text_instr(line: str) -> tuple[_Instr, bool] | None:
    m = _INSTR.match(_COMMENT.sub("", line))
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
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
    attrs = rest[end:]
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs) if opcode == "while" else None
    index = re.search(r"index=(\d+)", attrs) if opcode == "get-tuple-element" else None
    meta = re.search(r'op_name="([^"]*)"', attrs)
    groups, pairs = _text_groups(attrs) if _base_kind(opcode) else ((), False)
    param = int(operands[0]) if opcode == "parameter" and operands and operands[0].isdigit() else None
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs) if opcode == "dot" else None
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attrs) if opcode == "convolution" else None
    window = re.search(r"window=\{size=([0-9x]+)", attrs) if labels else None
    value = re.fullmatch(r"constant\((-?\d+)\)", rest[:end]) if opcode == "constant" else None
    direction = re.search(r"direction=([A-Z]+)", attrs) if opcode == "compare" else None
    return _Instr(
        name=name, opcode=opcode, arrays=_text_arrays(type_), is_tuple=type_.startswith("("),
        operands=() if opcode == "parameter" else operands, called=_text_called(attrs),
        trip_count=int(trip.group(1)) if trip else None, index=int(index.group(1)) if index else None,
        param=param, op_name=meta.group(1) if meta else "", groups=groups, pairs=pairs,
        contracting=tuple(_int_list(contracting.group(1))) if contracting else (),
        conv=(*labels.group(1, 2, 3), tuple(int(w) for w in window.group(1).split("x")) if window else ())
        if labels else None,
        value=int(value.group(1)) if value else None, direction=direction.group(1) if direction else "",
    ), is_root


def _module_from_text(hlo: str) -> _Module:
    comps: dict[str, list[_Instr]] = {}
    roots: dict[str, str] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if line.rstrip() == "}":  # (a Pallas call's attributes span lines, some starting with "}}")
            current = None
            continue
        if current is not None:
            parsed = _text_instr(line)
            if parsed is not None:
                ins, is_root = parsed
                comps[current].append(ins)
                if is_root:
                    roots[current] = ins.name
    for comp, instrs in comps.items():
        if comp not in roots and instrs:
            roots[comp] = instrs[-1].name
    module = _Module(comps, entry, roots)
    for instrs in comps.values():
        for k, ins in enumerate(instrs):
            if ins.opcode == "while" and ins.trip_count is None:
                instrs[k] = dataclasses.replace(ins, trip_count=_counted_trips(module, instrs, ins))
    return module


def _counted_trips(module: _Module, caller: list[_Instr], loop: _Instr) -> int | None:
    """The trip count of a `while` whose condition is `counter < N` with a constant N and whose body
    adds a constant step to the counter (the loops XLA:TPU writes for windowed matmuls carry no
    `known_trip_count`); the counter starts at its constant initial value, else 0. `None` otherwise."""
    called = dict(loop.called)
    cond = {i.name: i for i in module.comps.get(called.get("condition"), [])}
    root = cond.get(module.roots.get(called.get("condition"), ""))
    if root is None or root.opcode != "compare" or root.direction != "LT" or len(root.operands) != 2:
        return None
    counter, bound = (cond.get(o) for o in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.value is None:
        return None
    body = {i.name: i for i in module.comps.get(called.get("body"), [])}
    out = body.get(module.roots.get(called.get("body"), ""))
    step = None
    if out is not None and out.opcode == "tuple" and counter.index < len(out.operands):
        add = body.get(out.operands[counter.index])
        if add is not None and add.opcode == "add":
            step = next((c.value for c in (body.get(o) for o in add.operands) if c is not None and c.value), None)
    if not step or step < 0:
        return None
    names = {i.name: i for i in caller}
    init = names.get(loop.operands[0]) if loop.operands else None
    start = None
    if init is not None and init.opcode == "tuple" and counter.index < len(init.operands):
        first = names.get(init.operands[counter.index])
        start = first.value if first is not None else None
    trips = -(-(bound.value - (start or 0)) // step)
    return trips if trips > 0 else None


# ------------------------------------------------------------------ analysis (shared)


def _multiplicities(module: _Module) -> tuple[dict[str, int], set[str]]:
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




_WARNED_TEXT = False


def _module(compiled: Any) -> _Module:
    """The optimized HLO module of `compiled`: from its proto where JAX offers it, else text."""
    if isinstance(compiled, str):
        return _module_from_text(compiled)
    inner = getattr(compiled, "compiled", None)  # equinox's Compiled wraps jax's
    if inner is not None and hasattr(inner, "as_text"):
        compiled = inner
    if not hasattr(compiled, "as_text"):
        raise ValueError(
            f"collectives() needs a compiled program (jax.jit(f).lower(...).compile()) or its HLO "
            f"text; got {type(compiled).__name__}."
        )
    try:
        modules = compiled.runtime_executable().hlo_modules()
        serialized = modules[0].as_serialized_hlo_module_proto()
    except Exception as e:  # no proto from this backend or runtime: read the text instead
        global _WARNED_TEXT
        if not _WARNED_TEXT:
            _WARNED_TEXT = True
            logging.getLogger(__name__).warning(
                "collectives(): no HLO module proto from %s (%s); reading its HLO text.",
                type(compiled).__name__, e)
        serialized = None
    if serialized:
        return _module_from_proto(bytes(serialized))
    text = compiled.as_text()
    if not isinstance(text, str):
        raise ValueError("this compiled object has no HLO text (as_text() returned None).")
    return _module_from_text(text)


def _slice_uses(
    module: _Module, comp: str, name: str, elems: int, group: int, index: int | None, depth: int = 0,
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
        elif ins.opcode in _PASS_THROUGH:
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
    return _rows(_module(compiled), mesh)


def _rows(module: _Module, mesh: Any = None) -> list[Collective]:
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
                          replica_groups=_groups_text(groups, pairs), axes=axes, phase=phase,
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
