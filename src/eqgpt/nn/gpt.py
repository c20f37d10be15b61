"""GPT: token (+ position) embeddings -> scanned stack of blocks -> norm -> head.

The layers are one `Block` whose arrays carry a leading `layers` axis, built with
`eqx.filter_vmap` and run with `jax.lax.scan`: compile time does not grow with depth
(`GPTConfig.scan_layers=False` unrolls the scan, for faster steps of shallow models).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.config import GPTConfig
from eqgpt.nn.attention import Attention, KVCache
from eqgpt.nn.axes import ActivationHook, NoConstraint
from eqgpt.nn.block import Block, LayerGroup
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.factory import factory_path
from eqgpt.nn.linear import Linear
from eqgpt.nn.loss import mask_padded_vocab
from eqgpt.nn.mask import make_mask
from eqgpt.nn.mlp import MLP, SwiGLU
from eqgpt.nn.moe import MoE, MoEStats
from eqgpt.nn.norm import LayerNorm, RMSNorm, make_norm
from eqgpt.nn.protocol import LanguageModel
from eqgpt.tree import with_fields


def layers_per_block(config: GPTConfig) -> int:
    """Layers in one entry of the stack: `MoEConfig.every` (a `LayerGroup`), else 1."""
    return 1 if config.moe is None else config.moe.every


def make_block(config: GPTConfig, *, key: PRNGKeyArray) -> Block | LayerGroup:
    """One entry of the layer stack as `config` describes it: a block, or with
    `MoEConfig.every = n > 1` a `LayerGroup` of n-1 dense blocks and an MoE block.

    GPT-2 init: residual outputs scaled by 1/sqrt(2L).
    """
    n = layers_per_block(config)
    if n > 1:
        keys = jax.random.split(key, n)
        dense = config.replace(moe=None)
        return LayerGroup([_make_layer(dense, k) for k in keys[:-1]] + [_make_layer(config, keys[-1])])
    return _make_layer(config, key)


def stack_layers(make: Callable[[PRNGKeyArray], eqx.Module], keys: Array) -> eqx.Module:
    """`make(key)` for each of `keys`, stacked on a new leading axis: what `eqx.filter_vmap(make)(keys)`
    builds, with the same values.

    Traced (inside `jit`, as the recipe creates its model) the layers are drawn one at a time by
    `lax.map`: XLA:TPU compiles a loop drawing one layer's weights far faster than a program drawing
    all of them at once (llama-1b's initialiser for a v5e: 16.5 s against 3.0 s, `benchmarks/init_compile.py`).
    Eagerly, `vmap` reuses its compiled operations where a `lax.map` would compile its loop anew.
    """
    if not isinstance(keys, jax.core.Tracer):
        return eqx.filter_vmap(make)(keys)
    arrays = jax.lax.map(lambda k: eqx.filter(make(k), eqx.is_array), keys)
    _, static = eqx.partition(eqx.filter_eval_shape(make, keys[0]), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return eqx.combine(arrays, static)


def _make_layer(config: GPTConfig, key: PRNGKeyArray) -> Block:
    c = config
    ka, km = jax.random.split(key)
    out_std = c.init_std / math.sqrt(2 * c.num_layers)
    attn = Attention(
        c.embed_dim, c.num_heads, c.kv_heads, kernel=c.attention_kernel,
        mask=make_mask(c.mask, c.window), rope_theta=c.rope_theta if c.position == "rope" else None,
        use_bias=c.use_bias, init_std=c.init_std, out_init_std=out_std, key=ka,
    )
    if c.moe is not None:
        m = c.moe
        mlp = MoE(c.embed_dim, m.expert_dim or c.hidden_dim, m.num_experts, top_k=m.top_k,
                  capacity_factor=m.capacity_factor, dropless=m.dropless, num_shared=m.num_shared, kind=c.mlp,
                  renormalize=m.renormalize, init_std=c.init_std, out_init_std=out_std, key=km)
    else:
        mlp_cls = SwiGLU if c.mlp == "swiglu" else MLP
        mlp = mlp_cls(c.embed_dim, c.hidden_dim, use_bias=c.use_bias, init_std=c.init_std,
                      out_init_std=out_std, key=km)
    norm = lambda: make_norm(c.norm, c.embed_dim, eps=c.norm_eps, use_bias=c.use_bias)  # noqa: E731
    return Block(norm(), attn, norm(), mlp, remat=c.remat)


class GPT(LanguageModel):
    """A decoder-only transformer language model described by a `GPTConfig` (a `LanguageModel`)."""

    tok_embed: Embedding
    pos_embed: Embedding | None
    blocks: eqx.Module
    norm: LayerNorm | RMSNorm
    head: Linear | None
    shard: ActivationHook
    config: GPTConfig = eqx.field(static=True)
    block_factory_path: str = eqx.field(static=True)  # `module:name` of the factory that built the blocks

    def __init__(
        self,
        config: GPTConfig,
        *,
        key: PRNGKeyArray,
        block_factory: Callable[..., eqx.Module] | None = None,
    ):
        """**Arguments:**

        - `config`: the model's sizes and choices.
        - `key`: a `jax.random.PRNGKey`.
        - `block_factory`: `block_factory(config, key=key) -> Block` builds one layer
          (default `make_block`); pass your own to use your own attention, MLP or
          kernel in every layer (see `docs/extending.md`). `save_model` records its
          `module:name`, from which `load_model` imports it again.
        """
        c = config
        block_factory = make_block if block_factory is None else block_factory
        self.block_factory_path = factory_path(block_factory)
        kt, kp, kb, kh = jax.random.split(key, 4)
        self.tok_embed = Embedding(c.padded_vocab_size, c.embed_dim, axes=("vocab", "embed"), init_std=c.init_std,
                                   key=kt)
        self.pos_embed = (
            Embedding(c.seq_len, c.embed_dim, axes=(None, "embed"), init_std=0.01, key=kp)
            if c.position == "learned" else None
        )
        entries = c.num_layers // layers_per_block(c)
        self.blocks = stack_layers(lambda k: block_factory(c, key=k), jax.random.split(kb, entries))
        self.norm = make_norm(c.norm, c.embed_dim, eps=c.norm_eps, use_bias=c.use_bias)
        self.head = (
            None if c.tie_embeddings
            else Linear(c.embed_dim, c.padded_vocab_size, axes=("embed", "vocab"), use_bias=False,
                        init_std=c.init_std, key=kh)
        )
        self.shard = NoConstraint()
        self.config = c

    # ------------------------------------------------------------------ what layer-wise strategies read

    @property
    def seq_len(self) -> int:
        """The longest sequence the model takes (its positions)."""
        return self.config.seq_len

    def scanned(self) -> GPT:
        """This model with `scan_layers` on (`scan_unroll` 1): one layer compiled, however deep; the
        arrays are the same objects. Validation and sampling in the recipe run it."""
        if self.config.scan_layers and self.config.scan_unroll == 1:
            return self
        return with_fields(self, config=self.config.replace(scan_layers=True, scan_unroll=1))

    def logical_sizes(self) -> dict[str, int]:
        """The size of each logical axis of the model's arrays, and `seq_len` (`GPTConfig.logical_sizes`)."""
        return self.config.logical_sizes()

    @property
    def moe(self):
        """The `MoEConfig` of its MoE layers (their router losses), or `None` for a dense model."""
        return self.config.moe

    @property
    def num_moe_layers(self) -> int:
        """How many of its layers are MoE layers."""
        return 0 if self.config.moe is None else self.config.num_layers // self.config.moe.every

    @property
    def vocab_size(self) -> int:
        """The real rows of `head_matrix()` (the rest pad the vocabulary)."""
        return self.config.vocab_size

    def _check_len(self, t: int):
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than the model's seq_len ({self.config.seq_len}); "
                "shorten the batch or build the model with a larger seq_len."
            )

    def embed(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Int[Array, " seq"],
        doc_positions: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch local_seq embed"]:
        """Token embeddings plus learned position embeddings (when the model has them).

        The result holds the whole sequence, or this device's shard of it under manual
        sequence parallelism (the embeddings' parallel forms split it).

        `doc_positions` (per row, restarting at each packed document) replace `positions` here.
        """
        x = self.tok_embed(tokens)
        if self.pos_embed is not None:
            x = x + (self.pos_embed(positions)[None] if doc_positions is None else self.pos_embed(doc_positions))
        return self.shard(x, ("batch", "seq", "embed"))

    def run_blocks(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, " total_seq"],
        segment_ids: Int[Array, "batch total_seq"] | None = None,
        doc_positions: Int[Array, "batch total_seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Apply every layer in turn with `jax.lax.scan` over the stacked blocks.

        `positions` and the other per-token inputs cover the whole sequence, even
        where `x` holds a shard of it (manual sequence parallelism).
        """
        return self.run_blocks_with_stats(x, positions, segment_ids, doc_positions)[0]

    def run_blocks_with_stats(
        self,
        x: Float[Array, "batch seq embed"],
        positions: Int[Array, " total_seq"],
        segment_ids: Int[Array, "batch total_seq"] | None = None,
        doc_positions: Int[Array, "batch total_seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None]:
        """As `run_blocks`, also returning the MoE router statistics summed over the
        layers (`None` for a dense model, or blocks without `with_stats`)."""
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        extra = {} if doc_positions is None else {"doc_positions": doc_positions}  # user blocks need not take it

        def layer(h, params):
            block = eqx.combine(params, static)
            with jax.named_scope("block"):
                if hasattr(block, "with_stats"):
                    return block.with_stats(h, positions=positions, segment_ids=segment_ids, **extra)
                return block(h, positions=positions, segment_ids=segment_ids, **extra), None

        # The hook runs the stack: a scan, or a strategy's own way (eqgpt.parallel.overlap prefetches weights).
        unroll = self.config.scan_unroll if self.config.scan_layers else True
        x, stats = self.shard.run_stack(layer, x, dynamic, unroll=unroll)
        return x, jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)

    def features(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        doc_positions: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch local_seq embed"]:
        """Final-norm hidden states: everything but the head.

        `positions` (`[seq]`, default `0..seq-1`) index the sequence for the masks;
        `doc_positions` (`[batch, seq]`, packed documents: restarting per document)
        feed the position embeddings and RoPE instead when given.
        """
        return self.features_and_stats(tokens, positions=positions, segment_ids=segment_ids,
                                       doc_positions=doc_positions)[0]

    def features_and_stats(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        doc_positions: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch local_seq embed"], MoEStats | None]:
        """As `features`, also returning the MoE router statistics (see `run_blocks_with_stats`)."""
        self._check_len(tokens.shape[1])
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x, stats = self.run_blocks_with_stats(self.embed(tokens, positions, doc_positions), positions,
                                              segment_ids, doc_positions)
        return self.norm(x), stats

    def head_matrix(self) -> Float[Array, "vocab embed"]:
        """The output head as `[padded_vocab, embed]`: the token table when tied, else the head's
        weight transposed (`eqgpt.nn.lm_loss` fuses it with the loss, masking the padding rows)."""
        return self.tok_embed.weight if self.head is None else self.head.weight.T

    def head_logits(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """The output head (tied to the token table unless the model has its own), over the
        padded vocabulary: the padding ids' logits are -inf (`GPTConfig.vocab_pad_multiple`).
        Under manual tensor parallelism, this device's slice of the vocabulary."""
        head = self.tok_embed if self.head is None else self.head
        out = head.attend(h) if self.head is None else head(h)
        c = self.config
        if c.padded_vocab_size == c.vocab_size:
            return out
        start = head.vocab_start() if hasattr(head, "vocab_start") else 0  # a tensor-parallel slice's first id
        return mask_padded_vocab(out, c.vocab_size, start)

    def logits(self, h: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """`head_logits`, with the activations' layout named."""
        return self.shard(self.head_logits(h), ("batch", "inner_seq", "vocab"))

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None,
        doc_positions: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq vocab"]:
        """**Arguments:** `tokens`, optional global `positions`, `segment_ids` and
        per-row `doc_positions` (see `features`).

        **Returns:** next-token logits `[batch, seq, vocab_size]` (a padded vocabulary's extra
        columns dropped). For training use `eqgpt.nn.lm_loss`, which never materialises all
        the logits at once.
        """
        out = self.logits(self.features(tokens, positions=positions, segment_ids=segment_ids,
                                        doc_positions=doc_positions))
        v = self.config.vocab_size
        return out if out.shape[-1] == v else out[..., :v]

    def init_cache(self, batch: int, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty KV cache for every layer: arrays `[layers, batch, max_len, kv_heads, head_dim]`,
        in `dtype` (default: the model's own, so bf16 weights decode with a bf16 cache)."""
        c = self.config
        max_len = c.seq_len if max_len is None else max_len
        self._check_len(max_len)
        dtype = self.tok_embed.weight.dtype if dtype is None else dtype
        z = jnp.zeros((c.num_layers, batch, max_len, c.kv_heads, c.head_dim), dtype)
        return KVCache(z, z)

    def decode(
        self, tokens: Int[Array, "batch new"], cache: KVCache, index: Int[Array, ""] | int
    ) -> tuple[Float[Array, "batch new vocab"], KVCache]:
        """Logits for `tokens` at positions `index..` (over the padded vocabulary, padding at -inf),
        attending to the cache; the updated cache. A literal `index=0` (a prefill) reads nothing
        from the cache and attends with the model's own kernel."""
        fresh = isinstance(index, int) and index == 0
        index = jnp.asarray(index, jnp.int32)
        positions = index + jnp.arange(tokens.shape[1])
        x = self.embed(tokens, positions)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        n = layers_per_block(self.config)
        if n > 1:  # the cache's layers in the stack's groups
            cache = jax.tree.map(lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:]), cache)

        def layer(h, inputs):
            params, layer_cache = inputs
            return eqx.combine(params, static).decode(h, layer_cache, index)

        # The layers emit only their new rows, written once, in place, after the stack (a scan's
        # per-layer cache outputs would copy it all). Unrolled (`scan_layers=False`), each layer also
        # reads its cache in place; scanned, the program compiles one layer.
        unroll = self.config.scan_unroll if self.config.scan_layers else True
        x, rows = jax.lax.scan(layer, x, (dynamic, None if fresh else cache), unroll=unroll)
        write = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), index, axis=a.ndim - 3)  # noqa: E731
        cache = jax.tree.map(write, cache, rows)
        if n > 1:
            cache = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), cache)
        return self.logits(self.norm(x)), cache
