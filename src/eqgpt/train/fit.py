"""Does a compiled step fit the device? Checked before the first step, and the largest batch that does.

`check_fits(compile_step)` compiles the step and reads XLA's memory analysis of it
(arguments plus temporaries per device, `eqgpt.profile.memory`). If that exceeds
the device's memory, or the compiler itself runs out, it raises `DoesNotFit`, a
`ValueError` naming the GiB needed and available and the flags that would make it
fit, so a recipe stops with one clear line before anything is trained or written.

`largest_batch` finds the largest batch that fits from a few compiles: two sizes
give the memory's slope per row, then the prediction is checked (and halved until
it fits).

The device's memory is `memory_stats()["bytes_limit"]`; a backend without statistics
(the CPU) has no limit, unless `EQGPT_DEVICE_MEMORY_GIB` names one (to rehearse a
smaller device, as the tests do).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import jax

from eqgpt.profile.memory import memory

GIB = 2**30
FIXES = ("a smaller --batch-size (or --batch-size auto)", "--model.remat full (or save_qkv_proj, minimal)",
         "--accum-steps 2 or more", "--model.attention-kernel flash, splash or blockwise (never the [T, T] reference)",
         "--optim.mu-dtype bf16 and --master-weights (bf16 parameters)")


class DoesNotFit(ValueError):
    """The step needs more device memory than there is (a `ValueError`: a configuration to change)."""

    def __init__(self, needed: int | None, available: int, what: str):
        self.needed, self.available = needed, available
        need = "more memory than the device has" if needed is None else f"{needed / GIB:.2f} GiB of device memory"
        super().__init__(f"{what} needs {need} ({available / GIB:.2f} GiB available). "
                         f"To fit, try: {'; '.join(FIXES)}.")


def device_memory(device: jax.Device | None = None) -> int | None:
    """Bytes of memory of `device` (default: this process's first), or `None` where the backend does not say."""
    if os.environ.get("EQGPT_DEVICE_MEMORY_GIB"):
        return int(float(os.environ["EQGPT_DEVICE_MEMORY_GIB"]) * GIB)
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def step_bytes(compiled: Any) -> int:
    """Device bytes a compiled step holds at once: its arguments (less host-resident ones) plus temporaries."""
    report = memory(compiled)
    return report.device_argument_bytes + report.temp_bytes


def _out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text or "out of memory" in text.lower()


# XLA's out-of-memory errors name the bytes needed and available in one of two ways (sizes such as
# "20.66G", in units of 1024): "Used 20.07G of 15.75G hbm" (at allocation), and, from the TPU
# compiler, "the total memory required for HLO temporaries (20.66G) exceeds available HBM (15.75G)".
_NEEDED_OF_AVAILABLE = (re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT])"),
                        re.compile(r"\(([\d.]+)([KMGT])\) exceeds available \w+ \(([\d.]+)([KMGT])\)"))


def _needed_and_available(text: str) -> tuple[int, int] | None:
    """The bytes an out-of-memory error says were needed and available, if it says."""
    unit = lambda n, u: int(float(n) * 2 ** (10 * "KMGT".index(u) + 10))  # noqa: E731
    for pattern in _NEEDED_OF_AVAILABLE:
        if found := pattern.search(text):
            return unit(*found.group(1, 2)), unit(*found.group(3, 4))
    return None


def check_fits(compile_step: Callable[[], Any], *, what: str = "the training step",
               limit: int | None = None) -> Any:
    """Compile with `compile_step()` and **return** the compiled step if it fits the device's memory.

    Raises `DoesNotFit` if its arguments plus temporaries exceed `limit` (default
    `device_memory()`) or if the compiler runs out of memory. Where the limit is unknown
    (`None`), nothing is compiled and `None` is returned.
    """
    limit = device_memory() if limit is None else limit
    if limit is None:  # nothing to check against (a CPU): compile nothing here
        return None
    try:
        compiled = compile_step()
    except Exception as e:  # noqa: BLE001  (XLA's own out-of-memory error, at compile or allocation)
        if _out_of_memory(e):
            needed, available = _needed_and_available(str(e)) or (None, limit)
            raise DoesNotFit(needed, available, what) from None
        raise
    if (needed := step_bytes(compiled)) > limit:
        raise DoesNotFit(needed, limit, what)
    return compiled


def largest_batch(compile_at: Callable[[int], Any], *, multiple: int, start: int, limit: int | None = None,
                  log: Callable[[str], None] = lambda msg: None) -> int:
    """The largest batch (a multiple of `multiple`) whose step fits, from `compile_at(batch)`.

    Compiles at `start` and `2 * start` rows to read the memory per row, predicts the
    largest batch that fits, and checks it (halving until it fits). Raises `DoesNotFit`
    if not even `multiple` rows fit. Without a known `limit` (see `device_memory`), `start`.
    """
    limit = device_memory() if limit is None else limit
    if limit is None:
        return start

    def bytes_at(batch: int) -> int | None:  # None: the compiler itself ran out
        try:
            return step_bytes(compile_at(batch))
        except Exception as e:  # noqa: BLE001
            if _out_of_memory(e):
                return None
            raise

    small = bytes_at(start)
    if small is None or small > limit:
        if start <= multiple:
            raise DoesNotFit(small, limit, f"the training step at {start} rows")
        return largest_batch(compile_at, multiple=multiple, start=max(multiple, start // 2 // multiple * multiple),
                             limit=limit, log=log)
    large = bytes_at(2 * start)
    per_row = max(((large or 2 * small) - small) / start, 1.0)
    batch = max(start, int((limit * 0.95 - small) / per_row + start) // multiple * multiple)
    while batch > start:
        needed = bytes_at(batch)
        log(f"--batch-size auto: {batch} rows need "
            + ("more than the device has" if needed is None else f"{needed / GIB:.2f} GiB of {limit / GIB:.2f}"))
        if needed is not None and needed <= limit:
            return batch
        batch = max(start, batch // 2 // multiple * multiple)
    return start


__all__ = ["DoesNotFit", "device_memory", "step_bytes", "check_fits", "largest_batch"]
