"""`ParallelFlags`: a parallelism as flags, one optional part per kind.

    ParallelFlags(mesh="pipeline=2,data=4", rules="dp", pipeline=Pipeline("1f1b", 8)).strategy()

A new kind of parallelism is its module (a `Part`, a frozen dataclass of its settings)
and one line here: `name: MyPart | None = None`. On a tyro command line
(`recipes/train_gpt.py`) every part's settings become flags under one heading:

- the part's `switch` setting is `--NAME` (`--pipeline 1f1b`, `--zero 1`); a part
  without one is turned on by a bool `--NAME` (`--manual`), and a part of on/off
  settings only is on when any of them is (`--offload-params`);
- every other setting is `--NAME-SETTING`, or the spelling in its field's metadata
  `flag` (`--microbatches`); two parts' settings of one spelling are one flag
  (`--bucket-mb` sets the manual path's and the pipeline's);
- a setting given while its part is off is an error naming both flags.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

import jax

from eqgpt.parallel.context.part import Context
from eqgpt.parallel.expert import Expert
from eqgpt.parallel.manual import Manual
from eqgpt.parallel.mesh import make_mesh
from eqgpt.parallel.offload import Offload
from eqgpt.parallel.overlap import Overlap
from eqgpt.parallel.part import Part
from eqgpt.parallel.pipeline.part import Pipeline
from eqgpt.parallel.strategy import Strategy
from eqgpt.parallel.zero import Zero


@dataclass(frozen=True)
class ParallelFlags:
    """How the run is distributed: a device mesh, sharding rules and the parts of a `Strategy`."""

    mesh: str = ""
    ("Device mesh, e.g. 'pipeline=2,data=2,tensor=2' (axes data, fsdp, pipeline, context, expert, tensor; -1 fills); "
     "'' = one device.")
    rules: str = "dp"
    """Sharding rules on --mesh: presets dp, fsdp, tp, sp joined by '+' (e.g. 'fsdp+tp'); sp implies tp."""
    pipeline: Pipeline | None = None
    context: Context | None = None
    expert: Expert | None = None
    zero: Zero | None = None
    manual: Manual | None = None
    offload: Offload | None = None
    overlap: Overlap | None = None

    def parts(self) -> tuple[Part, ...]:
        """The parts these flags turn on (raises the `ValueError` a command line's flags gave)."""
        if getattr(self, "_error", None) is not None:
            raise self._error
        return tuple(p for f in _part_fields(type(self)) if (p := getattr(self, f)) is not None)

    def before_backend(self) -> None:
        """Call before JAX starts a backend: what the parts need then (`--overlap`: XLA's flags)."""
        for name in _part_fields(type(self)):
            if (part := getattr(self, name)) is not None:
                part.before_backend()

    def strategy(self, devices: list[jax.Device] | None = None) -> Strategy:
        """The `eqgpt.parallel.Strategy` (without --mesh: one device, or with several processes
        data parallelism over all their devices); its mesh over `devices` (default: all)."""
        parts = self.parts()
        mesh = self.mesh or ("data=-1" if jax.process_count() > 1 else "")
        return Strategy(make_mesh(mesh, devices) if mesh else None, self.rules, parts=parts)

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> ParallelFlags:
        """Flags from flag values by name (`{"mesh": ..., "pipeline": "1f1b", "microbatches": 8}`);
        a flag left out takes its default. Raises `ValueError` for a setting whose parts are all
        off, `TypeError` for an unknown name."""
        kinds, table = _part_fields(cls), _table(cls)
        unknown = set(values) - {"mesh", "strategy"} - {flag for flags in table.values() for flag in flags}
        if unknown:
            raise TypeError(f"unknown parallelism flags {sorted(unknown)}.")
        parts = {name: _part_of(kinds[name], flags, name, values) for name, flags in table.items()}
        for name, flags in table.items():
            for flag, s in flags.items():
                owners = [n for n, f in table.items() if flag in f]
                setting = s is not None and s != kinds[name].switch and flag in values
                if setting and values[flag] != _defaults(kinds[name])[s] and all(parts[o] is None for o in owners):
                    raise ValueError(f"{s} (--{flag.replace('_', '-')}) is a setting of "
                                     f"{' and '.join('--' + o for o in owners)} and does nothing without it: "
                                     + " or ".join(f"add --{o}" for o in owners) + ".")
        given = {"mesh": values.get("mesh", cls.mesh), "rules": values.get("strategy", cls.rules)}
        return cls(**given, **parts)

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        """Every flag's name (underscores for dashes): `mesh`, `strategy`, `pipeline`, `microbatches`, ..."""
        return ("mesh", "strategy", *dict.fromkeys(f for flags in _table(cls).values() for f in flags))

    @classmethod
    def parse(cls, mesh: str = "", rules: str = "dp", **flags: Any) -> Strategy:
        """A strategy from recipe flags, as keywords: `ParallelFlags.parse("pipeline=2,data=4", "dp",
        pipeline="1f1b", microbatches=8, context="ring", manual=True, zero=1, ...)`.

        **Arguments:** `mesh` ("" for one device, else e.g. "pipeline=2,data=2,tensor=2"),
        `rules` (presets joined by `+`), and any flag by its name without dashes
        (`pipeline_layers="4,4,4,0"`, `offload_params=True`, ...).
        """
        return Strategy(make_mesh(mesh) if mesh else None, rules, parts=cls.parts_of(flags))

    @classmethod
    def parts_of(cls, values: dict[str, Any]) -> tuple[Part, ...]:
        """The parts of flag values (`parse`'s keywords)."""
        return cls.from_flags(values).parts()


@functools.cache
def _part_fields(cls: type) -> dict[str, type[Part]]:
    """The fields of a `ParallelFlags` (sub)class that hold a part, and the part's class."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kinds = [t for t in typing.get_args(hints[f.name]) if isinstance(t, type) and issubclass(t, Part)]
        if kinds:
            out[f.name] = kinds[0]
    return out


def _defaults(kind: type[Part]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(kind)}


def _on_by_settings(kind: type[Part]) -> bool:
    """A part of on/off settings only (and no `switch`) is on when any of them is."""
    fields = dataclasses.fields(kind)
    return kind.switch is None and bool(fields) and all(f.default is False for f in fields)


def _flags(kind: type[Part], name: str) -> dict[str, str | None]:
    """Flag name -> the setting it sets (`None`: the bool that turns the part on)."""
    flags: dict[str, str | None] = {} if kind.switch or _on_by_settings(kind) else {name: None}
    for f in dataclasses.fields(kind):
        flags[name if f.name == kind.switch else f.metadata.get("flag", f"{name}_{f.name}")] = f.name
    return flags


@functools.cache
def _table(cls: type) -> dict[str, dict[str, str | None]]:
    """Part field -> its flags (`_flags`)."""
    return {name: _flags(kind, name) for name, kind in _part_fields(cls).items()}


def _part_of(kind: type[Part], flags: dict[str, str | None], name: str, values: dict[str, Any]) -> Part | None:
    """The part of `kind` the flag `values` turn on, or `None`."""
    settings = {s: values[flag] for flag, s in flags.items() if s is not None and flag in values}
    if kind.switch is not None:
        on = bool(settings.get(kind.switch))
    elif name in flags:
        on = bool(values.get(name))
    else:
        on = any(settings.values())
    return kind(**settings) if on else None


# ------------------------------------------------------------------ tyro


def _cli_fields(cls: type, default: ParallelFlags) -> list[tuple[str, Any, Any, Any]]:
    """(flag, type, default, help) of every flag of `cls`, defaults read off `default`."""
    out = {"mesh": (str, default.mesh, _doc(cls, "mesh")), "strategy": (str, default.rules, _doc(cls, "rules"))}
    for name, kind in _part_fields(cls).items():
        part, hints = getattr(default, name), typing.get_type_hints(kind)
        fields = {f.name: f for f in dataclasses.fields(kind)}
        for flag, s in _flags(kind, name).items():
            if flag in out:
                continue  # a setting shared with a part before (one flag sets both)
            if s is None:
                out[flag] = (bool, part is not None, kind.__doc__.split("\n")[0])
                continue
            hint = fields[s].metadata.get("cli", hints[s])
            value = getattr(part, s) if part is not None else fields[s].default
            if hint is str and isinstance(value, tuple):  # spelled as the flag is: "3,1"
                value = ",".join(map(str, value))
            if s == kind.switch:
                hint, value = hint | None, value if part is not None else None
            out[flag] = (hint, value, _doc(kind, s))
    return [(flag, *spec) for flag, spec in out.items()]


def _doc(cls: type, name: str) -> str | None:
    """The docstring below field `name` of `cls` (or of a class it derives from)."""
    for kls in cls.__mro__:
        doc = _field_docs(kls).get(name)
        if doc is not None:
            return doc
    return None


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Field -> the string literal below it in the body of `cls`, its single line breaks joined."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a builtin or a class without source
        return {}
    body, out = tree.body[0].body, {}
    for field, doc in zip(body, body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            paragraphs = inspect.cleandoc(doc.value.value).split("\n\n")
            out[field.target.id] = "\n\n".join(" ".join(p.split("\n")) for p in paragraphs).strip()
    return out


def _tyro_rule(info):
    """`ParallelFlags` (and subclasses) as flat flags in one group, defaults from the default instance."""
    from tyro.constructors import StructConstructorSpec, StructFieldSpec

    cls = info.type
    if not (isinstance(cls, type) and issubclass(cls, ParallelFlags)):
        return None
    default = info.default if isinstance(info.default, ParallelFlags) else cls()
    fields = tuple(StructFieldSpec(flag, hint, value, helptext) for flag, hint, value, helptext
                   in _cli_fields(cls, default))
    return StructConstructorSpec(instantiate=functools.partial(_parsed, cls), fields=fields)


def _parsed(cls: type[ParallelFlags], **values: Any) -> ParallelFlags:
    """`cls.from_flags(values)`; a `ValueError` is kept and raised by `strategy()`, so that a program
    reports it as its own (tyro would exit at once)."""
    try:
        return cls.from_flags(values)
    except ValueError as e:
        flags = cls(mesh=values.get("mesh", ""), rules=values.get("strategy", "dp"))
        object.__setattr__(flags, "_error", e)
        return flags


@functools.cache
def tyro_registry():
    """The `tyro.constructors.ConstructorRegistry` that parses `ParallelFlags` (and subclasses) as
    flat flags: pass it as `tyro.cli(Config, registry=tyro_registry())`."""
    from tyro.constructors import ConstructorRegistry

    registry = ConstructorRegistry()
    registry.struct_rule(_tyro_rule)
    return registry


__all__ = ["ParallelFlags", "tyro_registry"]
