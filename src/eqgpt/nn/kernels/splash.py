"""Splash attention: JAX's Pallas flash-attention kernel for TPU, behind the kernel signature.

`jax.experimental.pallas.ops.tpu.splash_attention` computes exact attention block
by block in VMEM, skipping blocks its mask rules out, with GQA/MQA served by
indexing (key/value heads are never repeated in memory). Here it gets:

- our masks: `CausalMask`, `SlidingWindowMask` (`i - window < j <= i`), `FullMask`,
  and segment ids (document masking) with any of them;
- block sizes and the fused backward per (sequence, head_dim, dtype) from `BLOCK_TABLE`,
  measured on a TPU v5e (`benchmarks/attention_speed.py`); JAX's default 128 is slower than XLA;
- a `shard_map` over every mesh axis the partitioner still owns, since GSPMD cannot
  split a Pallas call (`eqgpt.nn.kernels.mesh`);
- interpret mode off TPU, so CPU tests run the same kernel.

The mask works on sequence indices: `q_pos` and `k_pos` must be `0..len-1` (self-
attention over one whole sequence, as training runs it). Context parallelism hands
kernels that do not read positions the sequence in natural order
(`eqgpt.parallel.context.ulysses`), and decoding uses the `reference` kernel.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.mesh import on_local_shards
from eqgpt.nn.kernels.platform import interpret
from eqgpt.nn.mask import CausalMask, DocumentMask, FullMask, Mask, SlidingWindowMask

LANES = 128  # splash tiles are multiples of the TPU's 128 lanes


class Blocks(NamedTuple):
    """Splash tiling: query and key/value block sizes, and whether one fused kernel computes
    the backward pass (dq with dk, dv) instead of two."""

    q: int
    kv: int
    fused_backward: bool = True


# (seq_len, head_dim, dtype) -> Blocks; the largest entry with seq_len <= the sequence applies.
# Measured on one TPU v5e (docs/profiling_results.md, `benchmarks/attention_speed.py --sweep`):
# forward + backward, causal, 16k tokens, 12 heads (ms), square blocks 256/512/1024 at T=1024:
# 7.86 / 5.17 / 4.89; T=2048: 12.51 / 6.92 / 6.64; T=4096: 21.97 / 10.85 / 9.68; T=8192: 40.57 /
# 18.57 / 15.47 (two backward kernels). The fused backward kernel computes the scores once for dq, dk
# and dv: 1024-square blocks, two kernels against fused, T=2048: 6.45 / 5.63; 4096: 9.37 / 8.05; 8192:
# 15.29 / 12.91 (docs/measured/attention_fused_sweep.txt).
BLOCK_TABLE: dict[tuple[int, int, str], Blocks] = {
    (1024, 64, "bfloat16"): Blocks(1024, 1024, True),
}
DEFAULT_BLOCKS = Blocks(1024, 1024, True)
# Keys stored [heads, head_dim, seq] inside the kernel: measured 3% faster at T=1024, head_dim 64
# (the attention sublayer forward + backward, 5.56 -> 5.40 ms; docs/measured/attention_layouts.txt).
KEY_LAYOUT = sk.QKVLayout.SEQ_MINOR


def block_sizes(seq_len: int, head_dim: int, dtype) -> Blocks:
    """The tiling for this shape: the measured table, else `DEFAULT_BLOCKS`, blocks at most the sequence."""
    name = jnp.dtype(dtype).name
    rows = [(s, b) for (s, d, dt), b in BLOCK_TABLE.items() if d == head_dim and dt == name and s <= seq_len]
    blocks = max(rows)[1] if rows else DEFAULT_BLOCKS
    fit = lambda b: math.gcd(min(b, seq_len), seq_len)  # noqa: E731  (a divisor of the sequence)
    return Blocks(fit(blocks.q), fit(blocks.kv), blocks.fused_backward)


def supports(mask: Mask, seq_len: int) -> bool:
    """Whether the kernel runs this mask at this length (a multiple of 128)."""
    try:
        _splash_mask(mask)
    except ValueError:
        return False
    return seq_len % LANES == 0


def check_lengths(q_len: int, k_len: int) -> None:
    """Raise `ValueError` unless both lengths are multiples of 128 (the Pallas kernels' tiles)."""
    if q_len % LANES or k_len % LANES:
        raise ValueError(f'the Pallas attention kernels need sequence lengths that are multiples of {LANES}, got '
                         f'{q_len} queries and {k_len} keys; use kernel="blockwise" or pad the sequence.')


def _splash_mask(mask: Mask):
    """`(kind, window)` of a mask splash has a form of (exact types: a subclass may mean another mask)."""
    if type(mask) is DocumentMask:
        mask = mask.inner
    if type(mask) is SlidingWindowMask:  # splash's left window counts keys before i: window - 1
        return ("local", mask.window)
    if type(mask) is CausalMask:
        return ("causal", None)
    if type(mask) in (FullMask, Mask):
        return ("full", None)
    raise ValueError(f'attention kernel "splash" has no form of {type(mask).__name__}; '
                     'use kernel="blockwise" or "reference" for it.')


@functools.lru_cache(maxsize=64)
def _kernel(kind: str, window: int | None, heads: int, q_len: int, k_len: int, blocks: Blocks,
            interpret: bool) -> sk.SplashAttentionKernel:
    shape = (q_len, k_len)
    if kind == "causal":
        one = sm.CausalMask(shape)
    elif kind == "local":
        one = sm.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    else:
        one = sm.FullMask(shape)
    bq, bkv = blocks.q, blocks.kv
    dq = {} if blocks.fused_backward else dict(block_q_dq=bq, block_kv_dq=bkv)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, use_fused_bwd_kernel=blocks.fused_backward,
                          k_layout=KEY_LAYOUT, **dq)
    with jax.ensure_compile_time_eval():  # its mask tables are constants, cached across traces
        return sk.make_splash_mha(sm.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, interpret=interpret)


def local_splash(q, k, v, q_seg, k_seg, *, kind, window, scale):
    """Splash attention on one device's arrays (no mesh): `[b, t, h, d]` in, out; `kind` "causal", "local" or "full"."""
    b, t, h, d = q.shape
    s = k.shape[1]
    kernel = _kernel(kind, window, h, t, s, block_sizes(min(t, s), d, q.dtype), interpret())
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    q = heads_first(q * jnp.asarray(scale, q.dtype))  # splash takes no scale: pre-scale q (exact for d = 4^n)
    k, v = heads_first(k), heads_first(v)
    if q_seg is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        ids = lambda qs, ks: sk.SegmentIds(qs.astype(jnp.int32), ks.astype(jnp.int32))  # noqa: E731
        out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, ids(qs, ks)))(q, k, v, q_seg, k_seg)
    return heads_first(out)


def splash_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " s"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b s"] | None = None,
    scale: float | None = None,
) -> Float[Array, "b t h d"]:
    """Flash attention with JAX's Pallas splash kernel (TPU; interpret mode elsewhere).

    Positions must be `0..len-1` (see the module docstring); lengths multiples of 128.
    Raises `ValueError` for a mask it has no form of, or such a length.
    """
    del q_pos, k_pos  # sequence indices are the positions (module docstring)
    kind, window = _splash_mask(mask)
    check_lengths(q.shape[1], k.shape[1])
    if (q_seg is None) != (k_seg is None):
        raise ValueError("Pass both q_seg and k_seg, or neither.")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return on_local_shards(functools.partial(local_splash, kind=kind, window=window, scale=scale),
                           q, k, v, q_seg, k_seg)


__all__ = ["splash_attention", "local_splash", "Blocks", "block_sizes", "supports", "check_lengths"]
