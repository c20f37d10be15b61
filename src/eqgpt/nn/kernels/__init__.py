"""Attention kernels behind one signature.

Every kernel is a function

    kernel(q, k, v, *, mask, q_pos, k_pos, q_seg=None, k_seg=None, scale=None) -> out

with `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`,
`heads % kv_heads == 0` (MHA, GQA, MQA), global positions `q_pos: [q_len]`,
`k_pos: [k_len]`, optional segment ids `[batch, len]`, and `out` shaped like `q`.
Softmax statistics are fp32 whatever the input dtype.
"""

import importlib
from collections.abc import Callable

# name -> module defining `<name>_attention`; imported on first use.
KERNELS = ("reference", "blockwise", "cudnn")


def get_kernel(name: str) -> Callable:
    """Look up a kernel by name ("reference", "blockwise" or "cudnn")."""
    if name not in KERNELS:
        raise ValueError(f"Unknown attention kernel {name!r}; choose one of {list(KERNELS)}.")
    module = importlib.import_module(f"eqgpt.nn.kernels.{name}")
    return getattr(module, f"{name}_attention")


__all__ = ["KERNELS", "get_kernel"]
