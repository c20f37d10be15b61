"""Text generation with a KV cache: one prefill, then a scanned decode loop.

The prompt is run once through `GPT.decode` to fill the cache; each further token
costs one decode step that attends to the cache. The whole generation is one
compiled function (prefill + `jax.lax.scan`). Step `i` samples with
`jax.random.fold_in(key, i)`, so the result does not depend on how it is computed.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.nn.gpt import GPT


def sample_logits(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Int[Array, " batch"]:
    """Next tokens from `logits`: greedy if `temperature == 0`, else softmax sampling
    at `temperature` restricted to the `top_k` most likely tokens (all if `None`)."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, jnp.finfo(jnp.float32).min, logits)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _check(model: GPT, prompt_len: int, max_new_tokens: int, temperature: float, top_k: int | None):
    if prompt_len < 1:
        raise ValueError("the prompt needs at least one token.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if prompt_len + max_new_tokens > model.config.seq_len:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"seq_len ({model.config.seq_len}); generate fewer tokens or shorten the prompt."
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}.")


@eqx.filter_jit
def _generate(model, prompt, key, max_new_tokens, temperature, top_k):
    b, p = prompt.shape
    cache = model.init_cache(b, p + max_new_tokens)
    logits, cache = model.decode(prompt, cache, 0)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature=temperature, top_k=top_k)

    def step(carry, i):
        token, cache = carry
        logits, cache = model.decode(token[:, None], cache, p + i - 1)
        nxt = sample_logits(logits[:, -1], jax.random.fold_in(key, i), temperature=temperature, top_k=top_k)
        return (nxt, cache), token

    (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(1, max_new_tokens))
    new = jnp.concatenate([tokens.T, last[:, None]], axis=1) if max_new_tokens > 1 else last[:, None]
    return jnp.concatenate([prompt, new], axis=1)


def generate(
    model: GPT,
    prompt: Int[Array, "batch prompt"],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Int[Array, "batch total"]:
    """Continue `prompt` by `max_new_tokens` tokens with the KV cache.

    **Arguments:** a `GPT`, `prompt` token ids `[batch, prompt_len]`, the number of
    new tokens, a `key`, `temperature` (0 = greedy) and `top_k`.

    **Returns:** `[batch, prompt_len + max_new_tokens]`: the prompt and its continuation.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    _check(model, prompt.shape[1], max_new_tokens, temperature, top_k)
    return _generate(model, prompt, key, max_new_tokens, float(temperature), top_k)


def generate_text(
    model: GPT,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    num_samples: int = 1,
    temperature: float = 0.8,
    top_k: int | None = 40,
) -> list[str]:
    """`num_samples` continuations of the text `prompt` (prompt included), decoded."""
    ids = jnp.tile(jnp.asarray(tokenizer.encode(prompt), jnp.int32)[None], (num_samples, 1))
    out = generate(model, ids, max_new_tokens, key=key, temperature=temperature, top_k=top_k)
    return [tokenizer.decode(row) for row in jax.device_get(out)]
