"""Block factories by name: registered with `register_block`, or importable as `module:name`.

A run records its factory as `module:name` (`factory_path`), so that `load_model`,
`eqgpt-sample` and the export can build the same layers again (`get_block`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

BlockFactory = Callable[..., object]
DEFAULT_BLOCK = "eqgpt.nn.gpt:make_block"
_REGISTERED: dict[str, BlockFactory] = {}


def register_block(name: str, factory: BlockFactory) -> None:
    """Make `factory(config, *, key) -> Block` available as `--model.block NAME`."""
    if not callable(factory):
        raise ValueError(f"block factory {name!r} must be callable as factory(config, key=key), "
                         f"got {type(factory).__name__}.")
    _REGISTERED[name] = factory


def import_object(path: str) -> object:
    """The object `module:name` names (`name` may be dotted), importing its module."""
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(f"{path!r} is not of the form module:name (e.g. mypkg.blocks:my_block).")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {path!r} ({e}); put its package on "
                         "PYTHONPATH or install it.") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no {attr!r} (from {path!r}).")
        obj = getattr(obj, part)
    return obj


def get_block(name: str | BlockFactory | None) -> BlockFactory:
    """The factory for a registered name, a `module:name`, or `factory` itself (`None`: `make_block`)."""
    if name is None:
        name = DEFAULT_BLOCK
    if callable(name):
        return name
    if name in _REGISTERED:
        return _REGISTERED[name]
    if ":" not in name:
        raise ValueError(f"unknown block {name!r}: give module:name, or one registered with "
                         f"eqgpt.nn.register_block (registered: {list(_REGISTERED) or 'none'}).")
    factory = import_object(name)
    if not callable(factory):
        raise ValueError(f"{name!r} is a {type(factory).__name__}, not a block factory.")
    return factory


def factory_path(factory: BlockFactory | None) -> str:
    """`module:qualname` of `factory`, which `get_block` imports back (`None`: the default)."""
    if factory is None:
        return DEFAULT_BLOCK
    module = getattr(factory, "__module__", None) or type(factory).__module__
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{name}"


def import_modules(names) -> None:
    """Import each module of `--import` (a user's package registering kernels, blocks, presets)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"--import {name}: {e}; put its package on PYTHONPATH or install it.") from None
