"""Sampling with the KV cache equals sampling by recomputing the whole sequence."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.data import ByteTokenizer
from eqgpt.nn import GPT
from eqgpt.sample import generate, generate_text, sample_logits
from helpers import TINY


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
