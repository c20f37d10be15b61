"""All-gather-KV attention: queries stay sharded, keys and values are gathered.

Runs inside `jax.shard_map` over the context axis. Each device all-gathers the
key/value shards (and their positions and segment ids) of the axis, then runs the
blockwise kernel of its local queries against the whole sequence, skipping masked
tiles. JAX differentiates the gather: its transpose is a reduce-scatter that
hands every device the summed `dk, dv` of its own shard.

Communication per device: forward `(n-1)/n * |K + V|` (the gathered arrays),
backward the same again as a reduce-scatter of `dK, dV`. With GQA and few kv
heads `|K + V|` is small next to the queries, and one collective is cheaper than
`n-1` dependent ring steps; the price is memory: every device holds the whole
sequence's keys and values.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from eqgpt.nn.kernels.blockwise import blockwise_attention, tie_to_activations
from eqgpt.nn.mask import Mask
from eqgpt.parallel.collectives import all_gather


def allgather_attention(
    q: Float[Array, "b t h d"],
    k: Float[Array, "b t g d"],
    v: Float[Array, "b t g d"],
    *,
    mask: Mask,
    q_pos: Int[Array, " t"],
    k_pos: Int[Array, " t"],
    q_seg: Int[Array, "b t"] | None = None,
    k_seg: Int[Array, "b t"] | None = None,
    scale: float | None = None,
    axis: str = "context",
    block_q: int = 128,
    block_k: int = 128,
) -> Float[Array, "b t h d"]:
    """Attention of the local queries over all keys, gathered from every device on `axis`.

    Call inside `jax.shard_map` over `axis`. **Arguments:** as
    `eqgpt.parallel.context.ring_attention`. **Returns:** the local output shard.
    """
    q, k, v, q_pos, k_pos, q_seg, k_seg = tie_to_activations(q, k, v, q_pos, k_pos, q_seg, k_seg)
    gather = lambda x, dim: all_gather(x, axis, dim=dim)  # noqa: E731
    k_all, v_all, k_pos_all = gather(k, 1), gather(v, 1), gather(k_pos, 0)
    k_seg_all = None if k_seg is None else gather(k_seg, 1)
    return blockwise_attention(
        q, k_all, v_all, mask=mask, q_pos=q_pos, k_pos=k_pos_all, q_seg=q_seg, k_seg=k_seg_all,
        scale=scale, block_q=block_q, block_k=block_k,
    )


__all__ = ["allgather_attention"]
