"""Text generation with a KV cache, on one device or a mesh: one prefill, then a decode loop.

The prompt is run once through `GPT.decode` to fill the cache; each further token
costs one decode step that attends to the cache. The whole generation is one
compiled function (prefill + `jax.lax.while_loop`, which ends early once every row
has emitted a stop token). Step `i` samples with `jax.random.fold_in(key, i)`, so
the result does not depend on how it is computed.

**On a mesh** (`strategy=Strategy(make_mesh("data=2,tensor=4"), "dp+tp")`): the
model is placed by the strategy's rules (heads, MLP and vocabulary over `tensor`),
the prompt's rows go over `data`, and the KV cache `[layers, batch, len, kv_heads,
head_dim]` is constrained by the same logical rules as the activations
(`batch` -> `data`, `kv_heads` -> `tensor`): each device holds its rows' keys and
values of its heads only. Greedy decoding equals the single-device result.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqgpt.nn.attention import KVCache
from eqgpt.nn.gpt import GPT

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
"""Logical names of the KV cache's dimensions (the length is never split)."""


def sample_logits(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Int[Array, " batch"]:
    """Next tokens from `logits`: greedy if `temperature == 0`, else softmax sampling at
    `temperature` among the `top_k` most likely tokens (all if `None`) and, with `top_p`,
    the smallest set of them whose probability reaches `top_p` (nucleus sampling)."""
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    low = jnp.finfo(jnp.float32).min
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, low, logits)
    logits = logits / temperature
    if top_p is not None and top_p < 1.0:
        ranked = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the most likely token is always kept
        cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, low, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _settings(model: GPT, prompt_lens: Sequence[int], max_new_tokens: int, temperature: float, top_k: int | None,
              top_p: float | None, stop_tokens: Sequence[int]) -> tuple:
    """Every prompt length and setting checked (`_check`); **returns** the sampling settings as the
    compiled programs take them: `(temperature, top_k, top_p, stop_tokens)`, floats and a tuple of ints."""
    for prompt_len in prompt_lens:
        _check(model, int(prompt_len), max_new_tokens, temperature, top_k, top_p)
    return float(temperature), top_k, None if top_p is None else float(top_p), tuple(int(t) for t in stop_tokens)


def _check(model: GPT, prompt_len: int, max_new_tokens: int, temperature: float, top_k: int | None,
           top_p: float | None):
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
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p}.")


def constrain_cache(model: GPT, cache: KVCache) -> KVCache:
    """The cache pinned to the layout its logical names (`CACHE_AXES`) have under the model's
    rules: the model's own activation hook, so a placed model shards its cache and a
    single-device model leaves it alone."""
    return KVCache(model.shard(cache.k, CACHE_AXES), model.shard(cache.v, CACHE_AXES))


def prefill(
    model: GPT, prompt: Int[Array, "batch prompt"], max_len: int
) -> tuple[Float[Array, "batch prompt vocab"], KVCache]:
    """Run the prompt through the model into a fresh cache of `max_len` positions.

    **Returns:** the prompt's logits and the filled cache, sharded as `constrain_cache` says.
    Call it under `jax.jit` (as `generate` does) for the constraints to apply.
    """
    cache = constrain_cache(model, model.init_cache(prompt.shape[0], max_len))
    logits, cache = model.decode(prompt, cache, 0)
    return logits, constrain_cache(model, cache)


@eqx.filter_jit
def _generate(model, prompt, key, max_new_tokens, temperature, top_k, top_p, stop_tokens):
    b, p = prompt.shape
    pad = stop_tokens[0] if stop_tokens else 0
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    pick = lambda logits, i: sample_logits(logits[:, -1], jax.random.fold_in(key, i),  # noqa: E731
                                           temperature=temperature, top_k=top_k, top_p=top_p)
    logits, cache = prefill(model, prompt, p + max_new_tokens)
    first = pick(logits, 0)
    out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stops)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, out, done = carry
        logits, cache = model.decode(token[:, None], cache, p + i - 1)
        nxt = jnp.where(done, pad, pick(logits, i))
        out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return i + 1, nxt, constrain_cache(model, cache), out, done | jnp.isin(nxt, stops)

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), first, cache, out, done))
    return jnp.concatenate([prompt, out], axis=1)


def _place(strategy, model: GPT, prompt: Array) -> tuple[GPT, Array]:
    """The model in the strategy's layout and the prompt's rows over its batch axes."""
    if strategy is None or strategy.mesh is None:
        return model, prompt
    from jax.sharding import NamedSharding

    model = strategy.place_model(model)  # a no-op move for arrays already in place
    spec = strategy.rules.spec(("batch", None), "activations", shape=tuple(prompt.shape), mesh=strategy.mesh)
    return model, jax.device_put(prompt, NamedSharding(strategy.mesh, spec))


def generate(
    model: GPT,
    prompt: Int[Array, "batch prompt"],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    strategy=None,
) -> Int[Array, "batch total"]:
    """Continue `prompt` by up to `max_new_tokens` tokens with the KV cache.

    **Arguments:**

    - `model`, `prompt` token ids `[batch, prompt_len]`, the number of new tokens, a `key`.
    - `temperature` (0 = greedy), `top_k`, `top_p` (see `sample_logits`).
    - `stop_tokens`: a row that emits one of these ids stops; its later positions hold
      `stop_tokens[0]`, and decoding ends as soon as every row has stopped.
    - `strategy`: an `eqgpt.parallel.Strategy` to run on its mesh (prefill and decode with
      the strategy's tensor parallelism, rows over `data`); `None` runs where the model is.

    **Returns:** `[batch, prompt_len + max_new_tokens]`: the prompt and its continuation.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    settings = _settings(model, [prompt.shape[1]], max_new_tokens, temperature, top_k, top_p, stop_tokens)
    model, prompt = _place(strategy, model, prompt)
    return _generate(model, prompt, key, max_new_tokens, *settings)


def on_one_device(model: GPT) -> GPT:
    """`model` gathered onto this process's first device, with what any strategy installed
    undone (`Part.unprepare`: context kernels, expert dispatch) and its activation hooks back
    to no constraint: what `generate` runs, whatever mesh and strategy trained it (every
    process of a multi-process run must call it; each gets the whole model)."""
    from eqgpt.nn.axes import NoConstraint, map_constraints
    from eqgpt.parallel.part import KINDS

    for kind in KINDS:
        model = kind.unprepare(model)
    arrays, static = eqx.partition(map_constraints(model, lambda _path, _hook: NoConstraint()), eqx.is_array)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        arrays = jax.device_get(multihost_utils.process_allgather(arrays, tiled=True))
    # device to device (no copy for arrays already there), committed: the program compiled ahead serves it
    arrays = jax.device_put(arrays, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    return eqx.combine(arrays, static)


def _cut(text: str, start: int, stops: Sequence[str]) -> str:
    """`text` up to the first stop string after `start` (the prompt), the stop string excluded."""
    ends = [i for s in stops if (i := text.find(s, start)) >= 0]
    return text[: min(ends)] if ends else text


def prefill_bucket(shortest: int) -> int:
    """Tokens the batched sampler prefills: 1 below 16 (the rest of a short prompt goes through
    the decode loop), else the largest power of two up to the shortest prompt: few programs."""
    return 1 if shortest < 16 else 1 << (shortest.bit_length() - 1)


def rows_bucket(rows: int, multiple: int = 1) -> int:
    """Rows the batched sampler runs: a power of two of at least 4, rounded up to `multiple`
    (a mesh's batch divisor), so that 2 and 3 prompts share one program."""
    b = max(4, 1 << (rows - 1).bit_length())
    return -(-b // multiple) * multiple


@eqx.filter_jit
def _generate_rows(model, tokens, lengths, live, max_new_tokens, key, prefill_len, temperature, top_k, top_p,
                   stop_tokens):
    """`tokens` `[rows, seq_len]`: each row's prompt (`lengths`), then padding; rows not `live` are filler.
    Prefills `prefill_len` tokens, then one decode step per position: a step inside a row's prompt
    writes nothing (teacher forcing), a step past it writes a sampled token, until `max_new_tokens`."""
    b, total = tokens.shape
    pad = stop_tokens[0] if stop_tokens else 0
    stops = jnp.asarray(stop_tokens or (-1,), jnp.int32)
    ends = lengths + max_new_tokens
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(b))
    one = lambda k, lg, n: sample_logits(lg[None], jax.random.fold_in(k, n), temperature=temperature,  # noqa: E731
                                         top_k=top_k, top_p=top_p)[0]

    def advance(j, logits, tokens, done):  # logits [b, vocab] predict position j + 1
        pos = j + 1
        new = pos >= lengths
        live_row = new & ~done & (pos < ends)
        picked = jax.vmap(one)(keys, logits, pos - lengths)
        column = jax.lax.dynamic_index_in_dim(tokens, pos, axis=1, keepdims=False)
        tok = jnp.where(live_row, picked, jnp.where(new, pad, column))
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, pos, axis=1)
        done = done | (live_row & jnp.isin(tok, stops)) | (pos + 1 >= ends)
        return tokens, done

    logits, cache = prefill(model, tokens[:, :prefill_len], total)
    tokens, done = advance(prefill_len - 1, logits[:, -1], tokens, ~live)

    def cond(carry):
        j, _, _, done = carry
        return (j + 2 < total) & ~jnp.all(done)

    def body(carry):
        j, tokens, cache, done = carry
        j = j + 1
        token = jax.lax.dynamic_slice_in_dim(tokens, j, 1, axis=1)
        logits, cache = model.decode(token, cache, j)
        tokens, done = advance(j, logits[:, -1], tokens, done)
        return j, tokens, constrain_cache(model, cache), done

    _, tokens, _, _ = jax.lax.while_loop(cond, body, (jnp.asarray(prefill_len - 1), tokens, cache, done))
    return tokens


def generate_many(
    model: GPT,
    prompts: Sequence[Sequence[int] | np.ndarray],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    strategy=None,
    compiled=None,
) -> list[np.ndarray]:
    """Continue prompts of any lengths in one batch and one compiled program.

    The rows are padded to a power of two (at least 4) and to the model's `seq_len`, whose KV
    cache the program keeps whatever `max_new_tokens` is (a traced number): every call with
    the same sampling settings, prompts of 1..15 tokens and up to 4 rows runs the same
    program, from the trainer's end-of-run samples to `eqgpt-sample`. Row `r` samples step `i`
    with `fold_in(fold_in(key, r), i)`; greedy rows equal `generate` on that prompt alone.
    Arguments as `generate`'s, and `compiled`: the program from `lower_texts(...).compile()`, if compiled
    ahead. **Returns** each prompt followed by its continuation (up to `max_new_tokens`; after
    a stop token, `stop_tokens[0]`).
    """
    model, args = _rows_args(model, prompts, max_new_tokens, key, temperature, top_k, top_p, stop_tokens, strategy)
    out = np.asarray(jax.device_get((compiled or _generate_rows)(model, *args)))
    return [out[r, : len(ids) + max_new_tokens] for r, ids in enumerate(prompts)]


def _rows_args(model, prompts, max_new_tokens, key, temperature, top_k, top_p, stop_tokens, strategy):
    """The placed model and the rest of `_generate_rows`'s arguments for these prompts."""
    settings = _settings(model, [len(ids) for ids in prompts], max_new_tokens, temperature, top_k, top_p, stop_tokens)
    multiple = 1 if strategy is None or strategy.mesh is None else strategy.rows_divisor
    rows = rows_bucket(len(prompts), multiple)
    tokens = np.full((rows, model.config.seq_len), stop_tokens[0] if stop_tokens else 0, np.int32)
    lengths = np.ones(rows, np.int32)
    for r, ids in enumerate(prompts):
        tokens[r, : len(ids)], lengths[r] = ids, len(ids)
    live = np.arange(rows) < len(prompts)
    model, tokens = _place(strategy, model, jnp.asarray(tokens))
    arrays = (tokens, lengths, live, np.int32(max_new_tokens), key)
    if strategy is None or strategy.mesh is None:  # all committed to the model's device, however the model came:
        # the trainer's and eqgpt-sample's calls then lower to one program (one persistent-cache entry)
        params, static = eqx.partition(model, eqx.is_array)
        device = jax.sharding.SingleDeviceSharding(next(iter(jax.tree.leaves(params)[0].devices())))
        params, arrays = jax.device_put((params, arrays), device)
        model = eqx.combine(params, static)
    return model, (*arrays, prefill_bucket(min(len(p) for p in prompts)), *settings)


def _stops(tokenizer, stop: Sequence[str | int]) -> tuple[list[str], tuple[int, ...]]:
    """The stop strings, and the token ids that end decoding (ids, one-token strings, end-of-text)."""
    strings = [s for s in stop if isinstance(s, str)]
    tokens = [int(s) for s in stop if not isinstance(s, str)]
    tokens += [int(t[0]) for s in strings if len(t := tokenizer.encode(s)) == 1]
    eos = getattr(tokenizer, "eos_id", None)
    tokens += [eos] if eos is not None else []
    return strings, tuple(dict.fromkeys(tokens))


def _encode(tokenizer, prompts: Sequence[str]) -> list[np.ndarray]:
    """Each prompt's token ids (int32)."""
    return [np.asarray(tokenizer.encode(p), np.int32) for p in prompts]


def lower_texts(model: GPT, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, key: PRNGKeyArray,
                temperature: float = 0.8, top_k: int | None = 40, top_p: float | None = None,
                stop: Sequence[str | int] = ()):
    """The program `generate_texts` runs for these arguments, lowered (its `.compile()` goes to
    `generate_texts(..., compiled=)` with any model of the same shapes, any `key` and any
    `max_new_tokens`; the same settings, rows and prompt buckets). The recipe compiles it
    while it trains."""
    ids = _encode(tokenizer, prompts)
    model, args = _rows_args(model, ids, max_new_tokens, key, temperature, top_k, top_p, _stops(tokenizer, stop)[1],
                             None)
    return _generate_rows.lower(model, *args)


def generate_texts(
    model: GPT,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = None,
    stop: Sequence[str | int] = (),
    strategy=None,
    compiled=None,
) -> list[str]:
    """One continuation of each text in `prompts` (prompt included), decoded; all in one batch
    (`generate_many`: prompt `i` samples with `fold_in(key, i)`; `compiled`: `lower_texts(...).compile()`).

    `stop` holds token ids and strings: generation stops at a token id (and at the
    tokenizer's end-of-text token, if it has one); the text is cut before the first
    stop string that follows the prompt (strings that are one token also end decoding early).
    """
    ids = _encode(tokenizer, prompts)
    strings, tokens = _stops(tokenizer, stop)
    rows = generate_many(model, ids, max_new_tokens, key=key, temperature=temperature, top_k=top_k, top_p=top_p,
                         stop_tokens=tokens, strategy=strategy, compiled=compiled)
    texts = []
    for prompt, row in zip(ids, rows, strict=True):
        new = row[len(prompt):]
        hits = np.flatnonzero(np.isin(new, tokens)) if tokens else []
        new = new[: hits[0]] if len(hits) else new
        text = tokenizer.decode(np.concatenate([prompt, new]))
        texts.append(_cut(text, len(tokenizer.decode(prompt)), strings))
    return texts


def generate_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int, *, key: PRNGKeyArray,
                  num_samples: int = 1, **kwargs) -> list[str]:
    """`num_samples` continuations of the text `prompt`: `generate_texts` on that prompt repeated
    (sample `i` draws with `fold_in(key, i)`); keywords as there."""
    return generate_texts(model, tokenizer, [prompt] * num_samples, max_new_tokens, key=key, **kwargs)
