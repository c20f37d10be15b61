"""Wall-clock time of a compiled call, as the benchmarks take it."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(f, *args, repeats: int = 10) -> float:
    """Median seconds of `repeats` calls of `f(*args)`, each waited for, after one call that
    compiles it."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))

__all__ = ["median_seconds"]
