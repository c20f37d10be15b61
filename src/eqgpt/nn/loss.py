"""Language-model loss: fp32 cross-entropy over sequence chunks, with optional z-loss.

Logits are computed one chunk of positions at a time inside a checkpointed scan, so
neither the forward nor the backward pass holds the full `[batch, seq, vocab]` fp32
logits: only one `[batch, chunk, vocab]` slab at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


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
    c = min(chunk_size, t)
    pad = (-t) % c
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(mask, ((0, 0), (0, pad)))
    n = (t + pad) // c
    split = lambda a: jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)  # noqa: E731

    @jax.checkpoint
    def chunk(_, xs):
        h, y, m = xs
        nll, lse = cross_entropy(logits_fn(h), y)
        return None, (jnp.sum(nll * m), jnp.sum(jnp.square(lse) * m))

    _, (nll, z) = jax.lax.scan(chunk, None, (split(hidden), split(targets), split(mask)))
    return jnp.sum(nll), jnp.sum(z), jnp.sum(mask)


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
    if not hasattr(model, "features_and_stats"):
        hidden, stats = model.features(tokens, segment_ids=segment_ids, **extra), None
    else:
        hidden, stats = model.features_and_stats(tokens, segment_ids=segment_ids, **extra)
    loss, aux = chunked_cross_entropy(
        model.logits, hidden, targets, loss_mask=loss_mask, chunk_size=chunk_size, z_loss=z_loss
    )
    if stats is None:
        return loss, aux
    from eqgpt.nn.moe import moe_loss

    moe, metrics = moe_loss(stats, model.config.moe, rows=tokens.shape[0], tokens=tokens.size)
    return loss + moe, {**aux, **metrics}
