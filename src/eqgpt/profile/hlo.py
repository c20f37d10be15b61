"""An XLA HLO module as the profile reads it: `Module` (computations of `Instr`), parsed from
a compiled program's module proto or from HLO text.

`module_of(compiled)` reads a compiled program (or HLO text); `module_from_proto` and
`module_from_text` parse each form; `Instr` keeps only what the profile reads (result
arrays, operands, called computations, loop trip counts, device groups, op names).

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
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import eqgpt.profile.protowire as pw

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

DTYPE_BYTES = {
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
PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "convert"}

Array = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Instr:
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
    spaces: tuple[int, ...] = ()  # memory space of each array (text; 0: device memory, e.g. 1: a TPU's VMEM)


@dataclass(frozen=True)
class Module:
    comps: dict[str, list[Instr]]
    entry: str | None
    roots: dict[str, str]  # computation -> name of its root instruction


def is_array(dtype: str) -> bool:
    return dtype in DTYPE_BYTES or dtype.startswith(("f8", "f6", "f4"))


def nbytes(arr: Array) -> int:
    dtype, dims = arr
    return DTYPE_BYTES.get(dtype, 1) * math.prod(dims)


def array_text(arr: Array) -> str:
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


def groups_text(groups: tuple[tuple[int, ...], ...], pairs: bool) -> str:
    """Canonical text of device groups: members and groups sorted (pairs: pairs sorted)."""
    canon = sorted(groups) if pairs else sorted(tuple(sorted(g)) for g in groups)
    body = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in canon) + "}"
    return ("pairs" + body) if pairs else body if groups else ""


# ------------------------------------------------------------------ the HLO module proto


def _shape_arrays(shape: bytes) -> tuple[tuple[Array, ...], bool]:
    """ShapeProto (element_type 2, dimensions 3, tuple_shapes 4): its array leaves."""
    msg = pw.fields(shape)
    if pw.one(msg, 2, 0) == 13:  # TUPLE
        leaves = [a for t in msg.get(4, []) for a in _shape_arrays(t)[0]]
        return tuple(leaves), True
    dtype = _PRIMITIVE.get(pw.one(msg, 2, 0))
    return ((dtype, tuple(pw.ints(msg.get(3, [])))),) if dtype else (), False


def _proto_groups(ins: dict[int, list[Any]]) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """Device groups of a collective (HloInstructionProto fields 93, 92, 87, 49, 52)."""
    if 93 in ins:  # mesh_axes_replica_group_list: {mesh, axes}
        rg = pw.fields(pw.one(ins, 93))
        mesh = pw.fields(pw.one(rg, 1, b""))
        sizes = [pw.one(pw.fields(a), 2, 0) for a in mesh.get(1, [])]
        ids = None
        if mesh.get(2):
            ids = np.array(pw.ints(mesh[2]))
        elif 3 in mesh:
            it = pw.fields(pw.one(mesh, 3))
            ids = _iota(pw.ints(it.get(1, [])), pw.ints(it.get(2, [])))
        axes = []
        for ref in rg.get(2, []):
            ref = pw.fields(ref)
            sub = pw.fields(pw.one(ref, 2)) if 2 in ref else None
            axes.append((pw.one(ref, 1, 0), *((pw.one(sub, 1, 0), pw.one(sub, 2, 0)) if sub else (None, None))))
        return _mesh_groups(sizes, ids, axes), False
    if 92 in ins:  # iota_collective_device_list
        it = pw.fields(pw.one(ins, 92))
        ids = _iota(pw.ints(it.get(3, [])), pw.ints(it.get(4, [])))
        return tuple(map(tuple, ids.reshape(pw.one(it, 1, 0), pw.one(it, 2, 0)).tolist())), False
    lists = ([pw.fields(g) for g in pw.fields(pw.one(ins, 87, b"")).get(1, [])]
             or [pw.fields(g) for g in ins.get(49, [])])
    if lists:
        return tuple(t for t in (tuple(pw.ints(g.get(1, []))) for g in lists) if t), False
    if 52 in ins:  # source_target_pairs
        pairs = [pw.fields(p) for p in ins[52]]
        pairs = [(pw.one(p, 1, 0), pw.one(p, 2, 0)) for p in pairs]
        return tuple(p for p in pairs if p[0] != p[1]), True
    return (), False


_ROLES = {"while": ("body", "condition"), "conditional": ("branch",), "fusion": ("calls",),
          "call": ("calls",), "async-start": ("calls",)}


def module_from_proto(serialized: bytes) -> Module:
    """HloModuleProto: computations 3, entry_computation_id 6 (name 2)."""
    mod = pw.fields(serialized)
    raw = [pw.fields(c) for c in mod.get(3, [])]
    comp_names = {pw.one(c, 5, 0): pw.text(c, 1) for c in raw}
    entry = comp_names.get(pw.one(mod, 6, -1)) or pw.text(mod, 2) or None
    comps: dict[str, list[Instr]] = {}
    roots: dict[str, str] = {}
    for c in raw:  # HloComputationProto: name 1, instructions 2, id 5, root_id 6
        instrs = [pw.fields(i) for i in c.get(2, [])]
        names = {pw.one(i, 35, 0): pw.text(i, 1) for i in instrs}
        roots[pw.text(c, 1)] = names.get(pw.one(c, 6, 0), "")
        out = []
        for i in instrs:
            opcode = pw.text(i, 2)
            arrays, is_tuple = _shape_arrays(pw.one(i, 3, b""))
            callees = [comp_names.get(x, "") for x in pw.ints(i.get(38, []))]
            roles = _ROLES.get(opcode, ("to_apply",))
            called = tuple((roles[min(k, len(roles) - 1)], cname) for k, cname in enumerate(callees))
            trip = None
            if opcode == "while":
                m = re.search(rb'"known_trip_count":\{"n":"(\d+)"\}', bytes(pw.one(i, 43, b"")))
                trip = int(m.group(1)) if m else None
            groups, pairs = _proto_groups(i) if is_collective(opcode) else ((), False)
            out.append(Instr(
                name=pw.text(i, 1), opcode=opcode, arrays=arrays, is_tuple=is_tuple,
                operands=tuple(names.get(x, "") for x in pw.ints(i.get(36, []))), called=called,
                trip_count=trip, index=pw.one(i, 13, 0) if opcode == "get-tuple-element" else None,
                param=pw.one(i, 9, 0) if opcode == "parameter" else None,
                op_name=pw.text(pw.fields(pw.one(i, 7, b"")), 2), groups=groups, pairs=pairs,
                contracting=tuple(pw.ints(pw.fields(pw.one(i, 30, b"")).get(1, []))) if opcode == "dot" else (),
            ))
        comps[pw.text(c, 1)] = out
    return Module(comps, entry, roots)


def _counted_trips(module: Module, caller: list[Instr], loop: Instr) -> int | None:
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


def is_collective(opcode: str) -> bool:
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


_SPACED = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[[0-9,]*\](\{[^}]*\})?")


def _text_spaces(type_: str) -> tuple[int, ...]:
    """The memory space of each array of a type, from its layout's `S(n)` (0 without)."""
    return tuple(int(m.group(1)) if (m := re.search(r"S\((\d+)\)", layout or "")) else 0
                 for d, layout in _SPACED.findall(type_) if is_array(d))


def _text_arrays(type_: str) -> tuple[Array, ...]:
    return tuple((d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(type_)
                 if is_array(d))


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


def _text_instr(line: str) -> tuple[Instr, bool] | None:
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
    groups, pairs = _text_groups(attrs) if is_collective(opcode) else ((), False)
    param = int(operands[0]) if opcode == "parameter" and operands and operands[0].isdigit() else None
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs) if opcode == "dot" else None
    labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", attrs) if opcode == "convolution" else None
    window = re.search(r"window=\{size=([0-9x]+)", attrs) if labels else None
    value = re.fullmatch(r"constant\((-?\d+)\)", rest[:end]) if opcode == "constant" else None
    direction = re.search(r"direction=([A-Z]+)", attrs) if opcode == "compare" else None
    return Instr(
        name=name, opcode=opcode, arrays=_text_arrays(type_), is_tuple=type_.startswith("("),
        operands=() if opcode == "parameter" else operands, called=_text_called(attrs),
        trip_count=int(trip.group(1)) if trip else None, index=int(index.group(1)) if index else None,
        param=param, op_name=meta.group(1) if meta else "", groups=groups, pairs=pairs,
        contracting=tuple(_int_list(contracting.group(1))) if contracting else (),
        conv=(*labels.group(1, 2, 3), tuple(int(w) for w in window.group(1).split("x")) if window else ())
        if labels else None,
        value=int(value.group(1)) if value else None, direction=direction.group(1) if direction else "",
        spaces=_text_spaces(type_),
    ), is_root


def module_from_text(hlo: str) -> Module:
    comps: dict[str, list[Instr]] = {}
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
    module = Module(comps, entry, roots)
    for instrs in comps.values():
        for k, ins in enumerate(instrs):
            if ins.opcode == "while" and ins.trip_count is None:
                instrs[k] = dataclasses.replace(ins, trip_count=_counted_trips(module, instrs, ins))
    return module


_WARNED_TEXT = False


def module_of(compiled: Any) -> Module:
    """The optimized HLO module of `compiled`: from its proto where JAX offers it, else text."""
    if isinstance(compiled, str):
        return module_from_text(compiled)
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
        return module_from_proto(bytes(serialized))
    text = compiled.as_text()
    if not isinstance(text, str):
        raise ValueError("this compiled object has no HLO text (as_text() returned None).")
    return module_from_text(text)


__all__ = [
    "KINDS", "DTYPE_BYTES", "PASS_THROUGH", "Array", "Instr", "Module", "is_array", "nbytes", "array_text",
    "groups_text", "is_collective", "module_from_proto", "module_from_text", "module_of",
]
