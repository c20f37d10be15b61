"""Does a compiled step fit the device? Checked before the first step, and the largest batch that does.

`check_memory` refuses a step whose predicted bytes (`eqgpt.profile.estimate`) exceed the
device's before anything compiles; `fit_batch` then checks --batch-size by compiling (or
resolves 'auto'), as `eqgpt-train` runs them.

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

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from eqgpt.config import GPTConfig
from eqgpt.data.batch import Batch
from eqgpt.nn.kernels import auto_kernel_name
from eqgpt.nn.mask import make_mask
from eqgpt.parallel.strategy import Strategy
from eqgpt.precision import Policy
from eqgpt.profile.memory import memory
from eqgpt.train.step import make_train_step

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


def fit_batch(batch_size: int | str, optimizer: Any, state: Any, strategy: Strategy, policy: Policy, model_like: Any,
              *, seq_len: int, accum_steps: int, z_loss: float, log: Callable[[str], None]) -> tuple[int, Any]:
    """The step of `make_train_step(optimizer, ...)` from `state`: `batch_size` (--batch-size) checked against
    the device's memory by compiling the step, 'auto' resolved to the largest batch that fits; **returns** that
    batch and the compiled step (`None` where the device's memory is unknown, as on a CPU). Raises `DoesNotFit`
    (a `ValueError` naming the GiB and the flags to change) before anything is written."""
    @functools.cache  # 'auto' compiled the size it chose: the check below reuses that program
    def compile_at(rows: int):
        step = make_train_step(optimizer, strategy=strategy, policy=policy, accum_steps=accum_steps,
                               z_loss=z_loss, model_like=model_like)
        windows = np.zeros((rows // jax.process_count(), seq_len + 1), np.int32)
        return step.lower(state, strategy.batch(Batch.from_windows(windows))).compile()

    batch = batch_size
    if batch == "auto":
        multiple = strategy.rows_divisor * accum_steps
        batch = largest_batch(compile_at, multiple=multiple, start=max(multiple, 8 // multiple * multiple), log=log)
        strategy.check(model_like, batch_size=batch, seq_len=seq_len, accum_steps=accum_steps)
        log(f"--batch-size auto: {batch} sequences per step")
    compiled = check_fits(lambda: compile_at(batch), what=f"the training step at --batch-size {batch}")
    return batch, compiled


def check_memory(batch_size: int | str, model_cfg: GPTConfig, strategy: Strategy, policy: Policy) -> None:
    """Before the first compile: refuse a step whose predicted bytes per device (`eqgpt.profile.estimate`)
    exceed the memory it has: a CPU's RAM shared by its devices, or (by more than half again: the compiled
    step's check is exact there) an accelerator's. Names the flags that shrink it."""
    if batch_size == "auto":  # found by compiling, within the device's memory
        return
    from eqgpt.profile import estimate

    limit, margin, where = device_memory(), 1.5, "the device's memory"
    if limit is None:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(jax.local_devices())
        margin, where = 1.0, "this machine's memory" + (" per CPU device" if len(jax.local_devices()) > 1 else "")
    predicted = estimate(model_cfg, strategy=strategy, batch=batch_size, policy=policy,
                         scores=kernel_name(model_cfg, policy) == "reference").total
    if predicted > margin * limit:
        raise ValueError(
            f"--model.seq-len {model_cfg.seq_len} --batch-size {batch_size}: the step is predicted to need "
            f"{predicted / GIB:.1f} GiB per device (eqgpt.profile.estimate), above the {limit / GIB:.1f} GiB of "
            f"{where}; lower --model.seq-len or --batch-size, or add --accum-steps N or --model.remat full.")


def kernel_name(model_cfg: GPTConfig, policy: Policy) -> str:
    """The attention kernel the model runs ('auto' resolved for this backend and length)."""
    if model_cfg.attention_kernel != "auto":
        return model_cfg.attention_kernel
    mask = make_mask(model_cfg.mask, model_cfg.window)
    return auto_kernel_name(mask, model_cfg.seq_len, model_cfg.seq_len, policy.compute)


__all__ = ["DoesNotFit", "device_memory", "step_bytes", "check_fits", "largest_batch", "fit_batch", "check_memory",
           "kernel_name"]
