"""Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqgpt.nn.attention import KVCache
from eqgpt.nn.axes import ActivationHook, NoConstraint
from eqgpt.nn.moe import MoEStats, mlp_with_stats
from eqgpt.nn.remat import apply_remat, remat_policy


class Block(eqx.Module):
    """One transformer layer, with its gradient-checkpointing policy as a field.

    Any modules fit the four slots (see `docs/extending.md`): the norms and `mlp`
    map `[batch, seq, embed]` to the same shape; `attn` does so too and takes
    keyword `positions` and `segment_ids` (and, for generation, has `decode`
    like `eqgpt.nn.Attention`). Build weights from `eqgpt.nn.Linear` with logical
    axis names and every strategy places them.

    `remat` is one of `"none"`, `"full"`, `"dots"`, `"names:..."`, `"offload:..."`
    (see `eqgpt.nn.remat`).
    """

    attn_norm: eqx.Module
    attn: eqx.Module
    mlp_norm: eqx.Module
    mlp: eqx.Module
    shard: ActivationHook
    remat: str = eqx.field(static=True)

    def __init__(
        self,
        attn_norm: eqx.Module,
        attn: eqx.Module,
        mlp_norm: eqx.Module,
        mlp: eqx.Module,
        *,
        remat: str = "none",
    ):
        if remat != "none":
            remat_policy(remat)  # validate early
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.shard = NoConstraint()
        self.remat = remat

    def _forward(self, x, positions, segment_ids, doc_positions=None):
        x = self.shard(x, ("batch", "seq", "embed"))
        extra = {} if doc_positions is None else {"doc_positions": doc_positions}
        with jax.named_scope("attention"):  # named in traces (eqgpt.profile.trace)
            x = x + self.attn(self.attn_norm(x), positions=positions, segment_ids=segment_ids, **extra)
        x = self.shard(x, ("batch", "seq", "embed"))
        with jax.named_scope("mlp"):
            h, stats = mlp_with_stats(self.mlp, self.mlp_norm(x), positions)
        return self.shard(x + h, ("batch", "seq", "embed")), stats

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " total_seq"] | None = None,
        segment_ids: Int[Array, "batch total_seq"] | None = None,
        doc_positions: Int[Array, "batch total_seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """**Arguments:** activations `x`, global `positions`, optional `segment_ids` and
        per-row `doc_positions` (for RoPE; see `Attention`).

        **Returns:** the block output, shaped like `x`.
        """
        return self.with_stats(x, positions=positions, segment_ids=segment_ids, doc_positions=doc_positions)[0]

    def with_stats(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " total_seq"] | None = None,
        segment_ids: Int[Array, "batch total_seq"] | None = None,
        doc_positions: Int[Array, "batch total_seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
        """As `__call__`, also returning the MoE router statistics (`None` for a dense MLP)."""
        return apply_remat(Block._forward, self.remat)(self, x, positions, segment_ids, doc_positions)

    def decode(
        self, x: Float[Array, "batch new embed"], cache: KVCache | None, index: Int[Array, ""]
    ) -> tuple[Float[Array, "batch new embed"], KVCache]:
        """One incremental step reading the KV cache (no remat: there is no backward); returns
        the new tokens' keys and values for the caller to write."""
        h, cache = self.attn.decode(self.attn_norm(x), cache, index)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class LayerGroup(eqx.Module):
    """Consecutive layers run as one unit of the layer stack.

    A model whose layers differ in a repeating pattern (`MoEConfig.every = n`: n-1
    dense layers, then an MoE layer) stacks groups instead of layers, so the stack
    stays one scanned structure. Each layer keeps its own remat policy.
    """

    layers: tuple[eqx.Module, ...]

    def __init__(self, layers):
        self.layers = tuple(layers)

    def with_stats(self, x: Float[Array, "batch seq embed"], **kw) -> tuple[Float[Array, "batch seq embed"], Any]:
        """Each layer in turn; the MoE statistics of the group's MoE layers, summed."""
        total = None
        for layer in self.layers:
            x, stats = layer.with_stats(x, **kw)
            if stats is not None:
                total = stats if total is None else jax.tree.map(jnp.add, total, stats)
        return x, total

    def __call__(self, x: Float[Array, "batch seq embed"], **kw) -> Float[Array, "batch seq embed"]:
        return self.with_stats(x, **kw)[0]

    def decode(self, x: Float[Array, "batch new embed"], cache: KVCache | None, index: Int[Array, ""]):
        """One incremental step; `cache` holds the group's layers on a leading axis, as do the
        new keys and values returned."""
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, c = layer.decode(x, None if cache is None else KVCache(cache.k[i], cache.v[i]), index)
            ks.append(c.k)
            vs.append(c.v)
        return x, KVCache(jnp.stack(ks), jnp.stack(vs))
