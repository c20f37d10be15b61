"""Pytree helpers every layer uses: a JAX key path as one dotted string (sharding overrides,
checkpoints, Hugging Face tensor maps, replication checks), and a module with some fields changed."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

M = TypeVar("M")


def with_fields(module: M, **changes) -> M:
    """A copy of the dataclass (Equinox module) `module` with `changes` to its fields, static ones
    included, without running its `__init__`; every other field is the same object."""
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, changes.pop(f.name) if f.name in changes else getattr(module, f.name))
    if changes:
        raise TypeError(f"{type(module).__name__} has no fields {sorted(changes)}")
    return new


def path_str(path: tuple) -> str:
    """A JAX key path as a dotted string: `(.blocks, .attn, .q_proj)` -> `"blocks.attn.q_proj"`."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


__all__ = ["path_str", "with_fields"]
