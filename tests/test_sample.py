"""Sampling with the KV cache equals sampling by recomputing the whole sequence."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.data import ByteTokenizer
from eqgpt.nn import GPT
from eqgpt.sample import generate, generate_many, generate_text, generate_texts, sample_logits
from helpers import TINY, TINY_LLAMA


def generate_by_recompute(model, prompt, n, key, temperature, top_k):
    """No cache: every token reruns the model over the whole (zero-padded) sequence.

    Padding to a fixed length keeps one compiled forward; causality means the
    logits at position t see only tokens 0..t.
    """
    b, p = prompt.shape
    seq = jnp.zeros((b, p + n), jnp.int32).at[:, :p].set(prompt)
    forward = eqx.filter_jit(lambda m, s: m(s))
    for i in range(n):
        logits = forward(model, seq)[:, p + i - 1]
        nxt = sample_logits(logits, jax.random.fold_in(key, i), temperature=temperature, top_k=top_k)
        seq = seq.at[:, p + i].set(nxt)
    return seq


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (0.8, 5)])
def test_kv_cache_equals_full_recompute(temperature, top_k):
    # Larger init so greedy choices are decisive, not ties broken by rounding.
    model = GPT(TINY.replace(init_std=0.3), key=jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, TINY.vocab_size)
    key = jax.random.key(7)
    cached = generate(model, prompt, 8, key=key, temperature=temperature, top_k=top_k)
    full = generate_by_recompute(model, prompt, 8, key, temperature, top_k)
    assert cached.shape == (2, 13)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(full))


def test_top_k_restricts_choices():
    logits = jnp.array([[0.0, 1.0, 2.0, 3.0]] * 256)
    picks = sample_logits(logits, jax.random.key(0), temperature=5.0, top_k=2)
    assert set(np.asarray(picks).tolist()) == {2, 3}


def test_generate_text_and_bad_input():
    model = GPT(TINY.replace(vocab_size=256), key=jax.random.key(0))
    texts = generate_text(model, ByteTokenizer(), "def ", 6, key=jax.random.key(0), num_samples=2)
    assert len(texts) == 2 and all(t.startswith("def ") for t in texts)
    with pytest.raises(ValueError, match="seq_len"):
        generate(model, jnp.zeros((1, 30), jnp.int32), 10, key=jax.random.key(0))
    with pytest.raises(ValueError, match="temperature"):
        generate(model, jnp.zeros((1, 3), jnp.int32), 2, key=jax.random.key(0), temperature=-1.0)


def count_compiles(fn):
    """Run `fn()`; **returns** its result and the backend compiles per function name (jax.monitoring)."""
    from eqgpt.profile.compiles import CompileLog

    with CompileLog() as log:
        result = fn()
    return result, log.counts


@pytest.mark.slow
@pytest.mark.parametrize("config,lengths,sampled", [(TINY, (3, 7, 12), True), (TINY_LLAMA, (2, 5), False),
                                                    (TINY, (17, 21, 16), False)],
                         ids=["gpt2-prefill-1", "llama-prefill-1", "gpt2-prefill-16"])
def test_batched_prompts_equal_one_at_a_time(config, lengths, sampled):
    """Prompts of different lengths in one batch (one program): greedy rows are token for token
    what `generate` gives each prompt alone; sampled rows draw as the prompt alone did with key
    `fold_in(key, row)` (the trainer's end-of-run samples before they were batched)."""
    model = GPT(config.replace(init_std=0.3), key=jax.random.key(0))
    prompts = [np.asarray(jax.random.randint(jax.random.key(n), (n,), 0, config.vocab_size)) for n in lengths]
    n = 32 - max(lengths) - 1
    key = jax.random.key(5)
    for kw in ({"temperature": 0.0}, {"temperature": 0.8, "top_k": 8})[: 1 + sampled]:
        rows, compiles = count_compiles(lambda kw=kw: generate_many(model, prompts, n, key=key, **kw))
        assert compiles.get("_generate_rows") == 1, compiles  # every length, one program
        for i, (p, row) in enumerate(zip(prompts, rows, strict=True)):
            alone = generate(model, jnp.asarray(p)[None], n, key=jax.random.fold_in(key, i), **kw)[0]
            np.testing.assert_array_equal(row, np.asarray(alone), err_msg=f"prompt {i} ({len(p)} tokens), {kw}")


def test_batched_stop_tokens_and_text():
    """A row that emits a stop token holds `stop_tokens[0]` after it, as `generate` does; texts of
    different lengths come back in order, each starting with its prompt."""
    model = GPT(TINY.replace(vocab_size=256, init_std=0.3), key=jax.random.key(1))
    prompts = [np.arange(1, 4), np.arange(1, 9)]
    free = generate_many(model, prompts, 12, key=jax.random.key(0), temperature=0.0)
    stop = int(free[1][10])
    cut = generate_many(model, prompts, 12, key=jax.random.key(0), temperature=0.0, stop_tokens=(stop,))
    for p, c in zip(prompts, cut, strict=True):
        alone = generate(model, jnp.asarray(p)[None], 12, key=jax.random.key(0), temperature=0.0,
                         stop_tokens=(stop,))[0]
        np.testing.assert_array_equal(c, np.asarray(alone))
    assert (cut[1][11:] == stop).all()
    texts = generate_texts(model, ByteTokenizer(), ["de", "class "], 5, key=jax.random.key(0), temperature=0.0)
    assert [t[: len(p)] for t, p in zip(texts, ["de", "class "], strict=True)] == ["de", "class "]
