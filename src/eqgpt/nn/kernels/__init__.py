"""Attention kernels behind one signature.

Every kernel is a function

    kernel(q, k, v, *, mask, q_pos, k_pos, q_seg=None, k_seg=None, scale=None) -> out

with `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`,
`heads % kv_heads == 0` (MHA, GQA, MQA), global positions `q_pos: [q_len]`,
`k_pos: [k_len]`, optional segment ids `[batch, len]`, and `out` shaped like `q`.
Softmax statistics are fp32 whatever the input dtype.
"""

from eqgpt.nn.kernels.blockwise import blockwise_attention
from eqgpt.nn.kernels.cudnn import cudnn_attention
from eqgpt.nn.kernels.reference import reference_attention

KERNELS = {
    "reference": reference_attention,
    "blockwise": blockwise_attention,
    "cudnn": cudnn_attention,
}


def get_kernel(name: str):
    """Look up a kernel by name ("reference", "blockwise" or "cudnn")."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"Unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}."
        ) from None


__all__ = ["KERNELS", "get_kernel", "reference_attention", "blockwise_attention", "cudnn_attention"]
