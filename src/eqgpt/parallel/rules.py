"""Logical-axis rule sets: which mesh axes each logical dimension is split over.

A `Rules` has two tables (see `docs/design.md`): `params` for weight dimensions
and `activations` for activation dimensions. FSDP needs both: it splits the
*weight* `embed` dimension over `fsdp` while the *activation* `batch` dimension
goes over `(data, fsdp)`.

Strategies are rule sets, composed with `+`:

- `dp`:   batch over `data`.
- `fsdp`: weights' `embed` over `fsdp` (ZeRO-3: params, grads, optimizer state),
          batch over `(data, fsdp)`.
- `tp`:   Megatron: `heads`, `kv_heads`, `mlp`, `vocab` over `tensor`, weights
          and activations alike.
- `sp`:   `tp` plus the residual stream's `seq` over `tensor` (norms and residual
          adds run on a slice of the sequence between the tensor-parallel regions).

`preset_rules("dp+fsdp+tp")` merges presets; `Rules(params=..., activations=...)` is a
user-defined set, and `rules.update(...)` replaces single entries.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal, Union

from jax.sharding import Mesh, PartitionSpec

from eqgpt.parallel.mesh import AXES

logger = logging.getLogger(__name__)

MeshAxes = Union[str, tuple[str, ...], None]  # noqa: UP007 (used at runtime in isinstance-free checks)
AxisNames = tuple[Union[str, None], ...]  # noqa: UP007
Kind = Literal["params", "activations"]

# Logical names whose mesh axes are dropped (the dimension replicated) when they do
# not divide it: GQA with fewer kv heads than tensor ranks keeps whole kv heads on
# every rank, as Megatron does. Logged once per (name, size, axes).
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads"})
_logged: set = set()


def is_spec(x: object) -> bool:
    """Whether `x` is a `PartitionSpec` (the `is_leaf` of trees of specs)."""
    return isinstance(x, PartitionSpec)


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one `PartitionSpec` entry: `None` -> `()`, `"data"` -> `("data",)`."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis `spec` splits over, dimension by dimension."""
    return tuple(a for e in spec for a in entry_axes(e))


def _as_axes(value: MeshAxes, *, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    axes = (value,) if isinstance(value, str) else tuple(value)
    for a in axes:
        if a not in AXES:
            raise ValueError(f"{where}: unknown mesh axis {a!r}; mesh axes are {AXES}.")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where}: mesh axis repeated in {axes}.")
    return axes


class AxisTable(Mapping):
    """An immutable, hashable mapping: logical name -> tuple of mesh axes."""

    __slots__ = ("_items",)

    def __init__(self, table: Mapping[str, MeshAxes] | None = None, *, where: str = "rules"):
        items = {}
        for name, value in (table or {}).items():
            if not isinstance(name, str):
                raise ValueError(f"{where}: logical names are strings, got {name!r}.")
            items[name] = _as_axes(value, where=f"{where}[{name!r}]")
        self._items = tuple(sorted(items.items()))

    def __getitem__(self, name: str) -> tuple[str, ...]:
        for k, v in self._items:
            if k == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AxisTable) and other._items == self._items

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {v[0] if len(v) == 1 else (v or None)}" for k, v in self._items)
        return "{" + body + "}"


class Rules:
    """A rule set: two tables mapping logical names to mesh axes. Frozen and hashable.

    **Arguments:**

    - `params`: logical weight name -> mesh axis, tuple of axes, or `None`.
    - `activations`: logical activation name -> mesh axis, tuple of axes, or `None`.
    - `name`: a label for messages and tables.

    Names missing from a table are replicated.
    """

    __slots__ = ("params", "activations", "name")

    def __init__(
        self,
        params: Mapping[str, MeshAxes] | None = None,
        activations: Mapping[str, MeshAxes] | None = None,
        *,
        name: str = "custom",
    ):
        object.__setattr__(self, "params", AxisTable(params, where=f"{name}.params"))
        object.__setattr__(self, "activations", AxisTable(activations, where=f"{name}.activations"))
        object.__setattr__(self, "name", name)

    def __setattr__(self, *_):
        raise AttributeError("Rules are frozen; use .update(...) or .merge(...) for a new set.")

    def __hash__(self) -> int:
        return hash((self.params, self.activations))

    def __reduce__(self):  # frozen slots: rebuild through __init__ (pickle, deepcopy)
        return (_rebuild_rules, (dict(self.params), dict(self.activations), self.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and (self.params, self.activations) == (other.params, other.activations)

    def __repr__(self) -> str:
        return f"Rules({self.name!r}, params={self.params!r}, activations={self.activations!r})"

    def table(self, kind: Kind) -> AxisTable:
        if kind == "params":
            return self.params
        if kind == "activations":
            return self.activations
        raise ValueError(f'kind must be "params" or "activations", got {kind!r}.')

    def axes(self, name: str | None, kind: Kind = "params") -> tuple[str, ...]:
        """The mesh axes logical `name` is split over (empty: replicated)."""
        return () if name is None else self.table(kind).get(name, ())

    def spec(
        self,
        names: Iterable[str | None],
        kind: Kind = "params",
        *,
        shape: tuple[int, ...] | None = None,
        mesh: Mesh | None = None,
        units: Mapping[str, int] | None = None,
    ) -> PartitionSpec:
        """The `PartitionSpec` for an array whose dimensions have logical `names`.

        A mesh axis is used at most once per spec: the first dimension that asks for
        it gets it. With a `mesh`, axes of size 1 are left out. With `shape` and
        `mesh`, a weight dimension the axes do not divide raises `ValueError`, except
        the names in `REPLICATE_IF_INDIVISIBLE` (`kv_heads`), which are replicated.
        An activation dimension they do not divide is replicated (logged once): a
        decode step with one sequence on an 8-way batch mesh is legitimate, and
        training configurations are checked up front by `check_divisibility`.

        **Arguments:**

        - `names`: one logical name (or `None`) per array dimension.
        - `kind`: `"params"` or `"activations"`: which table to read.
        - `shape`, `mesh`: optional, to drop size-1 axes and check divisibility.
        - `units`: elements per unit of a name, e.g. `{"heads": head_dim}` for a
          flattened heads dimension, so that only whole heads are split.

        **Returns:** a `PartitionSpec` with one entry per dimension.
        """
        names = tuple(names)
        if shape is not None and len(shape) != len(names):
            raise ValueError(f"array of shape {shape} given {len(names)} logical names {names}.")
        used: set[str] = set()
        entries = []
        for i, name in enumerate(names):
            axes = tuple(a for a in self.axes(name, kind) if a not in used)
            if mesh is not None:
                axes = tuple(a for a in axes if mesh.shape[a] > 1)
            if shape is not None and mesh is not None and axes:
                n = math.prod(mesh.shape[a] for a in axes)
                unit = (units or {}).get(name, 1) if name else 1
                if shape[i] % unit or (shape[i] // unit) % n:
                    if name in REPLICATE_IF_INDIVISIBLE or kind == "activations":
                        key = (name, shape[i], axes)
                        if key not in _logged:
                            _logged.add(key)
                            logger.info("replicating %s (%d units) over mesh axes %s (not divisible by %d)",
                                        name, shape[i] // unit, axes, n)
                        axes = ()
                    else:
                        what = f"size {shape[i]}" if unit == 1 else f"{shape[i] // unit} units of {unit}"
                        raise ValueError(
                            f"{kind} dimension {i} ({name!r}) of shape {shape} has {what}, not "
                            f"divisible by mesh axes {axes} of total size {n} (rules {self.name!r}); "
                            "change the model size or the mesh."
                        )
            used.update(axes)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)

    def merge(self, other: Rules) -> Rules:
        """Union of two rule sets: a logical name gets the mesh axes of both, in mesh order.

        `preset_rules("dp+fsdp")` is `DP.merge(FSDP)`: batch over `data` and over
        `(data, fsdp)` becomes `(data, fsdp)`.
        """

        def union(a: AxisTable, b: AxisTable) -> dict[str, tuple[str, ...]]:
            out = {}
            for name in set(a) | set(b):
                axes = set(a.get(name, ())) | set(b.get(name, ()))
                out[name] = tuple(x for x in AXES if x in axes)
            return out

        return Rules(union(self.params, other.params), union(self.activations, other.activations),
                     name=f"{self.name}+{other.name}")

    __add__ = merge

    def update(
        self,
        params: Mapping[str, MeshAxes] | None = None,
        activations: Mapping[str, MeshAxes] | None = None,
        *,
        name: str | None = None,
    ) -> Rules:
        """A copy whose given entries replace this set's (`None` replicates a name)."""
        p = {**dict(self.params), **dict(params or {})}
        a = {**dict(self.activations), **dict(activations or {})}
        return Rules(p, a, name=name or f"{self.name}*")

    def uses(self, kind: Kind, mesh: Mesh | None = None) -> tuple[str, ...]:
        """Mesh axes (of size > 1 on `mesh`, if given) that this set splits `kind` over."""
        axes = {a for v in self.table(kind).values() for a in v}
        if mesh is not None:
            axes = {a for a in axes if mesh.shape[a] > 1}
        return tuple(a for a in AXES if a in axes)


def _rebuild_rules(params: dict, activations: dict, name: str) -> Rules:
    return Rules(params, activations, name=name)


_TP_NAMES = ("heads", "kv_heads", "mlp", "vocab")

DP = Rules(activations={"batch": "data"}, name="dp")
FSDP = Rules(params={"embed": "fsdp"}, activations={"batch": ("data", "fsdp")}, name="fsdp")
TP = Rules(params={n: "tensor" for n in _TP_NAMES}, activations={n: "tensor" for n in _TP_NAMES}, name="tp")
SP = TP.merge(Rules(activations={"seq": "tensor"})).update(name="sp")
REPLICATED = Rules(name="replicated")

PRESET_RULES: dict[str, Rules] = {"dp": DP, "fsdp": FSDP, "tp": TP, "sp": SP}


def preset_rules(spec: str | Rules) -> Rules:
    """Rules for a strategy name or `+`-composition: `"fsdp"`, `"dp+fsdp+tp"`, `"fsdp+sp"`.

    `sp` implies `tp`. A `Rules` passes through unchanged.

    **Arguments:** `spec`, preset names from `PRESET_RULES` joined by `+`.

    **Returns:** the merged `Rules`, named `spec`.
    """
    if isinstance(spec, Rules):
        return spec
    names = [s.strip() for s in spec.split("+") if s.strip()]
    if not names:
        raise ValueError(f"empty strategy {spec!r}; use e.g. 'dp', 'fsdp+tp', from {sorted(PRESET_RULES)}.")
    unknown = [n for n in names if n not in PRESET_RULES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown} in {spec!r}; combine {sorted(PRESET_RULES)} with '+'.")
    out = REPLICATED
    for n in names:
        out = out.merge(PRESET_RULES[n])
    return out.update(name="+".join(names))
