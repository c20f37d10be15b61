"""Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float, Int

from eqgpt.nn.attention import Attention, KVCache
from eqgpt.nn.axes import NoConstraint
from eqgpt.nn.mlp import MLP, SwiGLU
from eqgpt.nn.norm import LayerNorm, RMSNorm
from eqgpt.nn.remat import apply_remat, remat_policy


class Block(eqx.Module):
    """One transformer layer, with its gradient-checkpointing policy as a field.

    `remat` is one of `"none"`, `"full"`, `"dots"`, `"names:..."`, `"offload:..."`
    (see `eqgpt.nn.remat`).
    """

    attn_norm: LayerNorm | RMSNorm
    attn: Attention
    mlp_norm: LayerNorm | RMSNorm
    mlp: MLP | SwiGLU
    shard: NoConstraint
    remat: str = eqx.field(static=True)

    def __init__(
        self,
        attn_norm: LayerNorm | RMSNorm,
        attn: Attention,
        mlp_norm: LayerNorm | RMSNorm,
        mlp: MLP | SwiGLU,
        *,
        remat: str = "none",
    ):
        if remat != "none":
            remat_policy(remat)  # validate early
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.shard = NoConstraint()
        self.remat = remat

    def _forward(self, x, positions, segment_ids):
        x = self.shard(x, ("batch", "seq", "embed"))
        x = x + self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids)
        x = self.shard(x, ("batch", "seq", "embed"))
        x = x + self.mlp(self.mlp_norm(x))
        return self.shard(x, ("batch", "seq", "embed"))

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """**Arguments:** activations `x`, global `positions`, optional `segment_ids`.

        **Returns:** the block output, shaped like `x`.
        """
        return apply_remat(Block._forward, self.remat)(self, x, positions, segment_ids)

    def decode(
        self, x: Float[Array, "batch new embed"], cache: KVCache, index: Int[Array, ""]
    ) -> tuple[Float[Array, "batch new embed"], KVCache]:
        """One incremental step with a KV cache (no remat: there is no backward)."""
        h, cache = self.attn.decode(self.attn_norm(x), cache, index)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache
