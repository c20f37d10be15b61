"""The platform a traced program is compiled for, which picks kernels and Pallas's interpret mode.

By default it is JAX's backend. A program compiled for other devices (the planner's compile-only
TPU devices on a CPU host, `eqgpt.plan`) is traced inside `compiling_for(platform)`, so that `auto`
picks the TPU kernels and a Pallas kernel lowers as a Mosaic call, not as interpreted loops: the
compiler is handed the program the chip would run.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("eqgpt_target_platform", default=None)


def target_platform() -> str:
    """The platform being traced for: the innermost `compiling_for`, else `jax.default_backend()`."""
    return _TARGET.get() or jax.default_backend()


def interpret() -> bool:
    """Whether a Pallas TPU kernel runs in interpret mode (everywhere but on a TPU target)."""
    return target_platform() != "tpu"


def platform_of(mesh: Any) -> str | None:
    """The platform of a mesh's devices (`None` for no mesh)."""
    return None if mesh is None else mesh.devices.flat[0].platform


@contextlib.contextmanager
def compiling_for(platform: str | None) -> Iterator[None]:
    """Trace the body for `platform` ("tpu", "cpu", "gpu"); `None` keeps the current choice."""
    token = _TARGET.set(platform or _TARGET.get())
    try:
        yield
    finally:
        _TARGET.reset(token)


__all__ = ["target_platform", "interpret", "platform_of", "compiling_for"]
