"""Attention kernels behind one signature; open to your own.

Every kernel is a callable

    kernel(q, k, v, *, mask, q_pos, k_pos, q_seg=None, k_seg=None, scale=None) -> out

with `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`,
`heads % kv_heads == 0` (MHA, GQA, MQA), global positions `q_pos: [q_len]`,
`k_pos: [k_len]`, optional segment ids `[batch, len]`, and `out` shaped like `q`.
Softmax statistics are fp32 whatever the input dtype.

`Attention(kernel=...)` takes a registered name or any such callable (a function,
or an `eqx.Module` with no arrays, e.g. `eqgpt.parallel.context.ContextKernel`).
`register_kernel("mine", fn)` makes a name for it, usable from `GPTConfig`.

Built in: `reference` (dense, the oracle), `blockwise` (flash-style in plain JAX),
`splash` (JAX's Pallas TPU kernel; interpret mode elsewhere), `flash` (our own Pallas
kernel for causal attention on the model's layout, splash for every other case), `cudnn`
(GPU), and `auto`, which picks per call (`auto_kernel_name`): on TPU `flash` at the lengths
where it was measured faster than `splash` (`TPU_FLASH_LENGTHS`) and `splash` at others, `cudnn` on GPU,
and on CPU `reference` up to `CPU_BLOCKWISE_FROM` tokens, `blockwise` from there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax.numpy as jnp

Kernel = Callable[..., object]

# The built-in kernels: name -> module defining `<name>_attention`, imported on first use.
_BUILTIN = ("auto", "reference", "blockwise", "splash", "flash", "cudnn")
# On CPU, `auto` runs `blockwise` from this many keys on: measured forward + backward
# (`benchmarks/attention_speed.py --cpu`, docs/profiling_results.md).
CPU_BLOCKWISE_FROM = 512
# On TPU, `auto` runs `flash` at these sequence lengths, where a v5e measured it faster than
# `splash` (`benchmarks/attention_speed.py`, docs/measured/attention_flash.txt and
# attention_flash_512.txt), and `splash` elsewhere.
TPU_FLASH_LENGTHS = (512, 4096)
_REGISTERED: dict[str, Kernel] = {}


def register_kernel(name: str, kernel: Kernel) -> None:
    """Register `kernel` (a callable with the kernel signature) under `name`.

    Raises `ValueError` if `name` is a built-in kernel's or `kernel` is not callable.
    """
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in kernel; register yours under another name.")
    if not callable(kernel):
        raise ValueError(f"kernel {name!r} must be callable with the kernel signature, got {type(kernel).__name__}.")
    _REGISTERED[name] = kernel


def kernel_names() -> tuple[str, ...]:
    """Every name `get_kernel` accepts: the built-ins, then the registered ones."""
    return (*_BUILTIN, *_REGISTERED)


def get_kernel(kernel: str | Kernel) -> Kernel:
    """The kernel callable for a built-in or registered name, or `kernel` itself."""
    if callable(kernel):
        return kernel
    if kernel in _REGISTERED:
        return _REGISTERED[kernel]
    if kernel not in _BUILTIN:
        raise ValueError(
            f"Unknown attention kernel {kernel!r}; choose one of {list(kernel_names())}, pass a callable, "
            "or register one with eqgpt.nn.kernels.register_kernel."
        )
    if kernel == "auto":
        return auto_attention
    module = importlib.import_module(f"eqgpt.nn.kernels.{kernel}")
    return getattr(module, f"{kernel}_attention")


def auto_kernel_name(mask, q_len: int, k_len: int, dtype, platform: str | None = None) -> str:
    """The built-in kernel `auto` runs for these shapes on `platform` (default: the platform being traced
    for, `eqgpt.nn.kernels.platform.target_platform`)."""
    from eqgpt.nn.kernels.platform import target_platform

    platform = target_platform() if platform is None else platform
    if platform == "tpu":
        from eqgpt.nn.kernels.splash import supports
        from eqgpt.nn.kernels.typed import can_call_pallas

        if not (supports(mask, q_len) and supports(mask, k_len) and can_call_pallas()):
            return "blockwise"
        lo, hi = TPU_FLASH_LENGTHS
        return "flash" if lo <= q_len <= hi and lo <= k_len <= hi else "splash"
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"
    return "blockwise" if k_len >= CPU_BLOCKWISE_FROM else "reference"


def auto_attention(q, k, v, *, mask, q_pos, k_pos, q_seg=None, k_seg=None, scale=None):
    """The kernel signature; runs the built-in kernel `auto_kernel_name` picks for these shapes."""
    name = auto_kernel_name(mask, q.shape[1], k.shape[1], q.dtype)
    return get_kernel(name)(q, k, v, mask=mask, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, scale=scale)


__all__ = ["Kernel", "get_kernel", "register_kernel", "kernel_names", "auto_kernel_name",
           "CPU_BLOCKWISE_FROM", "TPU_FLASH_LENGTHS"]
