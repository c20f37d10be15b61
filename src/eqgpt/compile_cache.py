"""JAX's persistent compilation cache, as the recipes use it: every program, bounded, file-locked.

A second start with the same model, mesh, flags and JAX version reads its compiled
programs from the cache instead of compiling them (see `docs/profiling.md`, "Time to
the first step"). Bounding the cache's size turns on JAX's file lock around each read
and write, so processes sharing the directory never read an entry another is still
writing (the race that crashed test workers on jax 0.10.2).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from eqgpt.data.corpus import default_cache_dir

COMPILE_CACHE_BYTES = 4 << 30  # least recently used entries are evicted past this


def enable_compile_cache(directory: Path | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache for every program of this process.

    Call before the first compile. Leaves JAX's settings alone when the user already
    set a cache directory (`JAX_COMPILATION_CACHE_DIR`) or `EQGPT_NO_COMPILE_CACHE` is
    set (the test suite sets it).

    **Arguments:** `directory`: where the cache lives (default: `$EQGPT_CACHE/xla`,
    else `~/.cache/eqgpt/xla`).

    **Returns:** the cache directory, or `None` when left off.
    """
    if os.environ.get("EQGPT_NO_COMPILE_CACHE") or jax.config.jax_compilation_cache_dir:
        return None
    path = directory or default_cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the small programs add up too
    try:
        import filelock  # noqa: F401  (JAX locks a bounded cache with it)

        jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
    except ImportError:
        pass
    return path


__all__ = ["COMPILE_CACHE_BYTES", "enable_compile_cache"]
