"""Multi-head attention with grouped key/value heads (MHA, GQA, MQA)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.nn.axes import REGION_INPUT, ActivationHook, NoConstraint
from eqgpt.nn.kernels import Kernel, get_kernel
from eqgpt.nn.linear import Linear
from eqgpt.nn.mask import CausalMask, Mask
from eqgpt.nn.rope import apply_rope
from eqgpt.tree import with_fields


class KVCache(eqx.Module):
    """Keys and values of the tokens seen so far, `[batch, max_len, kv_heads, head_dim]`."""

    k: Float[Array, "*layers batch max_len kv_heads head_dim"]
    v: Float[Array, "*layers batch max_len kv_heads head_dim"]


class Attention(eqx.Module):
    """Causal self-attention with `num_heads` query heads sharing `num_kv_heads` kv heads.

    `num_kv_heads == num_heads` is MHA, `1` is MQA, anything dividing `num_heads` is
    GQA. The softmax runs in `kernel`: a registered name or any callable with the
    kernel signature (see `eqgpt.nn.kernels`); `with_kernel` swaps it, arrays kept.
    Query, key, value and output projections are tagged with `checkpoint_name`
    (`query_proj`, `key_proj`, `value_proj`, `attn_out`) for remat policies.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    mask: Mask
    shard: ActivationHook
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    kernel: str | Kernel = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        kernel: str | Kernel = "reference",
        mask: Mask | None = None,
        rope_theta: float | None = None,
        use_bias: bool = True,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `embed_dim`: model width; must be divisible by `num_heads`.
        - `num_heads`, `num_kv_heads`: query heads and key/value heads
          (`num_kv_heads` defaults to `num_heads` and must divide it).
        - `kernel`: "auto", "reference", "blockwise", "splash", "flash", "cudnn", a registered
          name, or a callable with the kernel signature.
        - `mask`: a `Mask`; causal by default.
        - `rope_theta`: apply rotary embeddings with this base, or `None` for none.
        - `use_bias`: biases on the projections (GPT-2 has them, Llama not).
        - `init_std`, `out_init_std`: init scales of the input and output projections.
        - `key`: a `jax.random.PRNGKey`.
        """
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}); "
                f"choose num_heads among the divisors of {embed_dim}."
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})."
            )
        get_kernel(kernel)
        head_dim = embed_dim // num_heads
        kq, kk, kv, ko = jax.random.split(key, 4)
        out_std = init_std if out_init_std is None else out_init_std
        kv_dim = num_kv_heads * head_dim
        self.q_proj = Linear(embed_dim, embed_dim, axes=("embed", "heads"),
                             use_bias=use_bias, init_std=init_std, key=kq)
        self.k_proj = Linear(embed_dim, kv_dim, axes=("embed", "kv_heads"),
                             use_bias=use_bias, init_std=init_std, key=kk)
        self.v_proj = Linear(embed_dim, kv_dim, axes=("embed", "kv_heads"),
                             use_bias=use_bias, init_std=init_std, key=kv)
        self.o_proj = Linear(embed_dim, embed_dim, axes=("heads", "embed"), use_bias=use_bias, init_std=out_std, key=ko)
        self.mask = CausalMask() if mask is None else mask
        self.shard = NoConstraint()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kernel = kernel
        self.rope_theta = rope_theta

    def project(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"] | Int[Array, "batch seq"]
    ) -> tuple[Array, Array, Array]:
        """Queries `[b, t, heads, d]` and keys, values `[b, t, kv_heads, d]`, rotated if RoPE.

        Head counts come from the projections' widths, so a projection swapped for a
        tensor-parallel one (fewer local heads) needs no other change.
        """
        b, t, _ = x.shape
        q = checkpoint_name(self.q_proj(x), "query_proj").reshape(b, t, -1, self.head_dim)
        k = checkpoint_name(self.k_proj(x), "key_proj").reshape(b, t, -1, self.head_dim)
        v = checkpoint_name(self.v_proj(x), "value_proj").reshape(b, t, -1, self.head_dim)
        if self.rope_theta is not None:
            q = apply_rope(q, positions, self.rope_theta)
            k = apply_rope(k, positions, self.rope_theta)
        q = self.shard(q, ("batch", "inner_seq", "heads", "head_dim"))
        k = self.shard(k, ("batch", "inner_seq", "kv_heads", "head_dim"))
        v = self.shard(v, ("batch", "inner_seq", "kv_heads", "head_dim"))
        return q, k, v

    def with_kernel(self, kernel: str | Kernel) -> Attention:
        """This module with another kernel (a name or a callable); the arrays are the same objects."""
        get_kernel(kernel)
        return with_fields(self, kernel=kernel)

    def output(self, o: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch out_seq embed"]:
        """Merge heads and apply the output projection (`out_seq` is `seq`, or under manual
        sequence parallelism this device's shard of it: its output projection reduce-scatters)."""
        b, t = o.shape[:2]
        o = self.shard(o, ("batch", "inner_seq", "heads", "head_dim"))
        y = checkpoint_name(self.o_proj(o.reshape(b, t, -1)), "attn_out")
        return self.shard(y, ("batch", "seq", "embed"))

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        *,
        positions: Int[Array, " total_seq"] | None = None,
        segment_ids: Int[Array, "batch total_seq"] | None = None,
        doc_positions: Int[Array, "batch total_seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """**Arguments:**

        - `x`: input activations.
        - `positions`: global token positions (default `0..seq-1`), for the mask.
        - `segment_ids`: document ids of packed sequences; no attention across them.
        - `doc_positions`: per-row positions within each packed document, for RoPE
          (default `positions`). The mask keeps `positions`: with `segment_ids`,
          causality by sequence index equals causality within each document.

        **Returns:** the attention output, shaped like `x`.
        """
        x = self.shard(x, REGION_INPUT)  # a tensor-parallel region starts here
        # Inside the region the sequence is whole (under sequence parallelism the hook gathered it).
        for name, arr in (("positions", positions), ("segment_ids", segment_ids), ("doc_positions", doc_positions)):
            if arr is not None and arr.shape[-1] != x.shape[1]:
                raise ValueError(f"Attention: {name} cover {arr.shape[-1]} positions but the input has seq="
                                 f"{x.shape[1]}; give one entry per token.")
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        q, k, v = self.project(x, positions if doc_positions is None else doc_positions)
        with jax.named_scope("softmax_attention"):  # the kernel alone, named in traces (eqgpt.profile.trace)
            o = get_kernel(self.kernel)(
                q, k, v, mask=self.mask, q_pos=positions, k_pos=positions,
                q_seg=segment_ids, k_seg=segment_ids,
            )
        return self.output(o)

    def decode(
        self, x: Float[Array, "batch new embed"], cache: KVCache | None, index: Int[Array, ""]
    ) -> tuple[Float[Array, "batch new embed"], KVCache]:
        """Attend `x` (tokens at positions `index..index+new-1`) to the cache's first `index`
        positions and to itself; `cache=None` is an empty cache (a prefill), which runs the
        model's own kernel.

        **Returns:** the output and the new tokens' keys and values (`[batch, new, kv_heads,
        head_dim]`), which the caller writes into its cache at `index`: the cache is only
        read here, so a decode step copies none of it.
        """
        positions = index + jnp.arange(x.shape[1])
        q, k, v = self.project(x, positions)
        if cache is None:
            o = get_kernel(self.kernel)(q, k, v, mask=self.mask, q_pos=positions, k_pos=positions)
        else:
            o = attend_cached(q, k, v, cache, self.mask, positions, index)
        return self.output(o), KVCache(k, v)


def attend_cached(
    q: Float[Array, "b t h d"], k: Float[Array, "b t g d"], v: Float[Array, "b t g d"], cache: KVCache,
    mask: Mask, positions: Int[Array, " t"], index: Int[Array, ""],
) -> Float[Array, "b t h d"]:
    """Softmax attention of the new queries over the cache's filled positions (`< index`) and
    the new keys, as one softmax in fp32 split in two parts, so the cache is never rewritten."""
    b, t, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, d) * jnp.asarray(d**-0.5, q.dtype)
    low = jnp.finfo(jnp.float32).min / 2
    cached = jnp.arange(cache.k.shape[1])
    keep_old = mask(positions, cached) & (cached < index)[None, :]  # [t, s]
    s_old = jnp.einsum("btgrd,bsgd->bgrts", qg, cache.k.astype(q.dtype), preferred_element_type=jnp.float32)
    s_new = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    s_old = jnp.where(keep_old, s_old, low)
    s_new = jnp.where(mask(positions, positions), s_new, low)
    top = jnp.maximum(s_old.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    p_old, p_new = jnp.exp(s_old - top), jnp.exp(s_new - top)
    total = p_old.sum(-1) + p_new.sum(-1)  # [b, g, r, t]
    o = (jnp.einsum("bgrts,bsgd->bgrtd", p_old.astype(v.dtype), cache.v.astype(v.dtype),
                    preferred_element_type=jnp.float32)
         + jnp.einsum("bgrts,bsgd->bgrtd", p_new.astype(v.dtype), v, preferred_element_type=jnp.float32))
    o = o / total[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
