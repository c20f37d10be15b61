"""Language-model loss: fp32 cross-entropy over sequence chunks, with optional z-loss.

Logits are computed one chunk of positions at a time inside a checkpointed scan, so
neither the forward nor the backward pass holds the full `[batch, seq, vocab]` fp32
logits: only one `[batch, chunk, vocab]` slab at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


def mask_padded_vocab(
    logits: Float[Array, "*batch vocab"], vocab_size: int, start: Int[Array, ""] | int = 0
) -> Float[Array, "*batch vocab"]:
    """`logits` with the columns of ids `>= vocab_size` (a padded vocabulary's extra rows) at
    -inf, so softmax, the loss and sampling give them nothing and no gradient reaches them.
    `start` is the id of the first column (a tensor-parallel shard's offset)."""
    if isinstance(start, int) and start + logits.shape[-1] <= vocab_size:
        return logits
    ids = start + jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < vocab_size, logits, jnp.asarray(-jnp.inf, logits.dtype))


def dense_cross_entropy(
    logits: Float[Array, "*batch vocab"], targets: Int[Array, "*batch"]
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """Per-position `(nll, lse)` of full logits, in fp32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], lse


def chunked_loss_sums(
    logits_fn: Callable[[Array], Array],
    hidden: Float[Array, "batch seq embed"],
    targets: Int[Array, "batch seq"],
    *,
    loss_mask: Float[Array, "batch seq"] | None = None,
    chunk_size: int = 128,
    cross_entropy: Callable[[Array, Array], tuple[Array, Array]] = dense_cross_entropy,
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """Masked sums of the NLL and of `lse^2`, and the token count, one chunk at a time.

    The sequence is padded to a multiple of `chunk_size` and scanned in chunks
    under `jax.checkpoint`, so only one `[batch, chunk, vocab]` slab of logits is
    alive in the forward or the backward pass. Per-chunk sums leave the scan as
    stacked outputs, not a carry, so the same code runs inside `shard_map`.

    **Arguments:** `logits_fn` (the head), `hidden`, `targets`, `loss_mask` and
    `chunk_size` as `chunked_cross_entropy`; `cross_entropy(logits, targets) ->
    (nll, lse)` per position (dense by default; vocabulary-parallel under manual TP).

    **Returns:** `(nll_sum, z_sum, count)`. Its ops carry the named scope `loss`
    (`jax.named_scope`), which traces and `eqgpt.profile.trace.op_table` show.
    """
    with jax.named_scope("loss"):
        return _chunked_loss_sums(logits_fn, hidden, targets, loss_mask, chunk_size, cross_entropy)


def _chunked_loss_sums(logits_fn, hidden, targets, loss_mask, chunk_size, cross_entropy):
    b, t, _ = hidden.shape
    mask = jnp.ones((b, t), jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
    hs, ys, ms, _ = _split_chunks(hidden, targets, mask, min(chunk_size, t))

    @jax.checkpoint
    def chunk(_, xs):
        h, y, m = xs
        nll, lse = cross_entropy(logits_fn(h), y)
        return None, (jnp.sum(nll * m), jnp.sum(jnp.square(lse) * m))

    _, (nll, z) = jax.lax.scan(chunk, None, (hs, ys, ms))
    return jnp.sum(nll), jnp.sum(z), jnp.sum(mask)


def head_loss_sums(
    hidden: Float[Array, "batch seq embed"],
    weight: Float[Array, "vocab embed"],
    targets: Int[Array, "batch seq"],
    *,
    loss_mask: Float[Array, "batch seq"] | None = None,
    chunk_size: int = 128,
    z_loss: float = 0.0,
    vocab_size: int | None = None,
) -> tuple[Float[Array, ""], tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]]:
    """The output head `hidden @ weight.T` and its cross-entropy, gradients made in the same pass.

    One chunk of positions at a time (as `chunked_loss_sums`), each chunk's logits are
    computed once, in fp32 from the inputs' dtype (`preferred_element_type`), and turned
    into the loss *and* into the gradients of `hidden` and `weight`; the backward pass
    only scales them. So the logits are never recomputed and never held whole. With
    `vocab_size` below `weight`'s rows, the rest are padding (`mask_padded_vocab`): they get
    no probability and exactly zero gradient.

    **Returns:** `(total, (nll_sum, z_sum, count))` with `total = nll_sum + z_loss * z_sum`
    (masked sums over positions), differentiable in `hidden` and `weight`; the second
    part carries no gradient.
    """
    with jax.named_scope("loss"):
        b, t, _ = hidden.shape
        mask = jnp.ones((b, t), jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
        vocab = weight.shape[0] if vocab_size is None else int(vocab_size)
        total, (nll, z) = _fused_head_loss(hidden, weight, targets, mask, min(chunk_size, t), float(z_loss), vocab)
        stats = jax.lax.stop_gradient((nll, z, jnp.sum(mask)))
        return total, stats


def _split_chunks(hidden, targets, mask, c):
    """`[n, b, c, ...]` chunks of `c` positions (the sequence padded to a multiple), and the padding."""
    b, t, _ = hidden.shape
    pad = (-t) % c
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    n = (t + pad) // c
    split = lambda a: jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)  # noqa: E731
    return split(hidden), split(targets), split(mask), pad


def _head_logits(h, weight, y, vocab):
    """One chunk's fp32 logits (from `h`'s dtype; ids from `vocab` on at -inf), their logsumexp
    and the NLL of `y`."""
    logits = mask_padded_vocab(jnp.einsum("bcd,vd->bcv", h, weight, preferred_element_type=jnp.float32), vocab)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return logits, lse, lse - jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]


def _fused_head_loss_fwd(hidden, weight, targets, mask, c, z_weight, vocab):
    hs, ys, ms, pad = _split_chunks(hidden, targets, mask, c)
    f32 = jnp.float32

    def chunk(d_weight, xs):
        h, y, m = xs
        logits, lse, nll = _head_logits(h, weight, y, vocab)
        probs = jnp.exp(logits - lse[..., None])
        # d(nll + z_weight * lse^2)/d logits = softmax - onehot + 2 z_weight lse softmax, per counted position
        d_logits = probs * (1.0 + 2.0 * z_weight * lse)[..., None] * m[..., None]
        d_logits = d_logits - jax.nn.one_hot(y, logits.shape[-1], dtype=f32) * m[..., None]
        d_logits = d_logits.astype(h.dtype)
        d_h = jnp.einsum("bcv,vd->bcd", d_logits, weight, preferred_element_type=f32).astype(h.dtype)
        d_weight = d_weight + jnp.einsum("bcv,bcd->vd", d_logits, h, preferred_element_type=f32)
        return d_weight, (jnp.sum(nll * m), jnp.sum(jnp.square(lse) * m), d_h)

    # The first chunk starts the sum, so the carry has the type its sum will have (varying over
    # the axes `hidden` varies over, inside shard_map), which zeros would not.
    d_weight, first = chunk(0.0, (hs[0], ys[0], ms[0]))
    nll, z, d_h = (a[None] for a in first)
    if hs.shape[0] > 1:
        d_weight, rest = jax.lax.scan(chunk, d_weight, (hs[1:], ys[1:], ms[1:]))
        nll, z, d_h = (jnp.concatenate([a, b]) for a, b in zip((nll, z, d_h), rest, strict=True))
    b, t = hidden.shape[:2]
    d_h = jnp.moveaxis(d_h, 0, 1).reshape(b, t + pad, -1)[:, :t]
    nll, z = jnp.sum(nll), jnp.sum(z)
    return (nll + z_weight * z, (nll, z)), (d_h, d_weight.astype(weight.dtype), targets, mask)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_head_loss(hidden, weight, targets, mask, c, z_weight, vocab):
    """Without differentiation (evaluation): the loss alone, one matmul per chunk."""
    hs, ys, ms, _ = _split_chunks(hidden, targets, mask, c)

    def chunk(_, xs):
        h, y, m = xs
        _, lse, nll = _head_logits(h, weight, y, vocab)
        return None, (jnp.sum(nll * m), jnp.sum(jnp.square(lse) * m))

    _, (nll, z) = jax.lax.scan(chunk, None, (hs, ys, ms))
    nll, z = jnp.sum(nll), jnp.sum(z)
    return nll + z_weight * z, (nll, z)


def _fused_head_loss_bwd(c, z_weight, vocab, res, cotangents):
    d_h, d_weight, targets, mask = res
    g = cotangents[0]  # the statistics carry no gradient (head_loss_sums stops it)
    scale = lambda x: (x.astype(jnp.float32) * g).astype(x.dtype)  # noqa: E731
    int_zero = np.zeros(targets.shape, jax.dtypes.float0)
    return scale(d_h), scale(d_weight), int_zero, jnp.zeros_like(mask)


_fused_head_loss.defvjp(_fused_head_loss_fwd, _fused_head_loss_bwd)


def chunked_cross_entropy(
    logits_fn: Callable[[Array], Array],
    hidden: Float[Array, "batch seq embed"],
    targets: Int[Array, "batch seq"],
    *,
    loss_mask: Float[Array, "batch seq"] | None = None,
    chunk_size: int = 128,
    z_loss: float = 0.0,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Mean next-token cross-entropy (nats/token) of `logits_fn(hidden)` against `targets`.

    **Arguments:**

    - `logits_fn`: maps hidden states `[b, c, D]` to logits `[b, c, V]` (the head).
    - `hidden`, `targets`: final hidden states and target ids.
    - `loss_mask`: weights per position (1 counts, 0 ignores); default all ones.
    - `chunk_size`: positions per chunk; the sequence is padded to a multiple.
    - `z_loss`: weight of `mean(logsumexp(logits)^2)` (PaLM's z-loss), 0 to disable.

    **Returns:** `(loss, {"nll": ..., "z_loss": ...})`; `loss = nll + z_loss * z`.
    """
    nll, z, count = chunked_loss_sums(
        logits_fn, hidden, targets, loss_mask=loss_mask, chunk_size=chunk_size
    )
    count = jnp.maximum(count, 1.0)
    nll, z = nll / count, z / count
    return nll + z_loss * z, {"nll": nll, "z_loss": z}


def lm_loss(
    model,
    tokens: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    *,
    loss_mask: Float[Array, "batch seq"] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None,
    chunk_size: int = 128,
    z_loss: float = 0.0,
    doc_positions: Int[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Chunked cross-entropy of a `GPT` on `tokens` predicting `targets`.

    `doc_positions`: per-row positions of packed documents (see `GPT.features`).

    **Returns:** `(loss, aux)` as `chunked_cross_entropy`; use with `has_aux=True`. For a
    model with MoE layers the loss also holds their auxiliary losses, and `aux` their
    metrics (`eqgpt.nn.moe.moe_loss`).
    """
    extra = {} if doc_positions is None else {"doc_positions": doc_positions}
    hidden, stats = model.features_and_stats(tokens, segment_ids=segment_ids, **extra)
    head = model.head_matrix()
    if head is not None:  # the fused head: logits once, gradients in the same pass
        total, (nll, z, count) = head_loss_sums(hidden, head, targets, loss_mask=loss_mask, chunk_size=chunk_size,
                                                z_loss=z_loss, vocab_size=model.vocab_size)
        count = jnp.maximum(count, 1.0)
        loss, aux = total / count, {"nll": nll / count, "z_loss": z / count}
    else:
        loss, aux = chunked_cross_entropy(
            model.logits, hidden, targets, loss_mask=loss_mask, chunk_size=chunk_size, z_loss=z_loss
        )
    return add_router_losses(model, loss, aux, stats, rows=tokens.shape[0], tokens=tokens.size)


def lm_batch_loss(model, batch: Any, *, chunk_size: int = 128, z_loss: float = 0.0):
    """`lm_loss` of `model` on a batch (an `eqgpt.data.Batch`, or anything with its fields).

    Per-row `batch.positions` (packed documents) feed the position embeddings and RoPE.
    """
    return lm_loss(model, batch.tokens, batch.targets, loss_mask=batch.loss_mask,
                   segment_ids=batch.segment_ids, chunk_size=chunk_size, z_loss=z_loss,
                   doc_positions=batch.positions)


def add_router_losses(model, loss: Array, aux: dict, stats, *, rows: int, tokens: int) -> tuple[Array, dict]:
    """`(loss, aux)` with the MoE router losses of `stats` added to `loss` and their metrics to
    `aux` (`eqgpt.nn.moe.moe_loss`); unchanged when `stats` is `None` (a dense model).

    `stats` are sums over all `rows` sequences (`tokens` tokens) of the step: a split of the
    sequence or of the rows must sum its shares' statistics before they come here.
    """
    if stats is None:
        return loss, aux
    from eqgpt.nn.moe import moe_loss

    moe, metrics = moe_loss(stats, model.moe, rows=rows, tokens=tokens)
    return loss + moe, {**aux, **metrics}
