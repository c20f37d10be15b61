"""Generation on a mesh: greedy decoding on data=2,tensor=4 equals one device token for token; the
KV cache is sharded by the logical rules; top-p and stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from eqgpt.data import ByteTokenizer
from eqgpt.nn import GPT
from eqgpt.parallel import Strategy, make_mesh
from eqgpt.sample import generate, generate_many, generate_text, prefill, sample_logits
from helpers import TINY

CONFIG = TINY.replace(seq_len=48, init_std=0.3)  # a larger init: greedy choices decisive, not rounding ties


@pytest.fixture(scope="module")
def setup():
    model = GPT(CONFIG, key=jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (4, 8), 0, CONFIG.vocab_size)
    return model, prompt, Strategy(make_mesh("data=2,tensor=4"), "dp+tp")


def test_greedy_on_data2_tensor4_equals_one_device(setup):
    model, prompt, strategy = setup
    one = generate(model, prompt, 32, key=jax.random.key(0), temperature=0.0)
    mesh = generate(model, prompt, 32, key=jax.random.key(0), temperature=0.0, strategy=strategy)
    assert mesh.shape == (4, 40) and len(mesh.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(mesh), np.asarray(one))
    assert len(set(np.asarray(one)[:, 8:].ravel().tolist())) > 4  # not one repeated token


def test_prompts_of_different_lengths_on_the_mesh_equal_one_device(setup):
    """The batched sampler on data=2,tensor=4: rows over data, greedy rows as on one device."""
    model, prompt, strategy = setup
    prompts = [np.asarray(prompt[0, :3]), np.asarray(prompt[1]), np.asarray(prompt[2, :5])]
    one = generate_many(model, prompts, 20, key=jax.random.key(0), temperature=0.0)
    mesh = generate_many(model, prompts, 20, key=jax.random.key(0), temperature=0.0, strategy=strategy)
    for a, b in zip(one, mesh, strict=True):
        np.testing.assert_array_equal(a, b)


def test_kv_cache_is_sharded_by_the_logical_rules(setup):
    model, prompt, strategy = setup
    placed = strategy.place_model(model)
    rows = jax.device_put(prompt, NamedSharding(strategy.mesh, PartitionSpec("data")))
    logits, cache = jax.jit(prefill, static_argnums=2)(placed, rows, 40)
    assert cache.k.shape == (CONFIG.num_layers, 4, 40, CONFIG.kv_heads, CONFIG.head_dim)
    want = NamedSharding(strategy.mesh, PartitionSpec(None, "data", None, "tensor", None))
    for x in (cache.k, cache.v):
        assert x.sharding.is_equivalent_to(want, 5), x.sharding
        assert {s.data.shape for s in x.addressable_shards} == {(2, 2, 40, 1, 8)}  # rows / 2, heads / 4
    assert logits.sharding.is_equivalent_to(NamedSharding(strategy.mesh, PartitionSpec("data", None, "tensor")), 3)
    one_logits, one_cache = jax.jit(prefill, static_argnums=2)(model, prompt, 40)
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(one_cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(one_logits), atol=1e-4)


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 512))
    picks = set(np.asarray(sample_logits(logits, jax.random.key(0), top_p=0.7)).tolist())
    assert picks == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert set(np.asarray(sample_logits(logits, jax.random.key(0), top_p=0.01)).tolist()) == {0}
    with pytest.raises(ValueError, match="top_p"):
        generate(GPT(CONFIG, key=jax.random.key(0)), jnp.zeros((1, 2), jnp.int32), 2, key=jax.random.key(0),
                 top_p=1.5)


def test_stop_tokens_and_strings(setup):
    model, prompt, strategy = setup
    free = np.asarray(generate(model, prompt, 12, key=jax.random.key(3), temperature=0.0))
    stop = int(free[0, 8 + 3])
    out = np.asarray(generate(model, prompt, 12, key=jax.random.key(3), temperature=0.0, stop_tokens=(stop,),
                              strategy=strategy))
    for row, ref in zip(out, free, strict=True):
        new, ref_new = row[8:], ref[8:]
        hits = np.flatnonzero(ref_new == stop)
        end = hits[0] + 1 if len(hits) else len(ref_new)
        np.testing.assert_array_equal(new[:end], ref_new[:end])  # the same until the stop token
        assert (new[end:] == stop).all()  # then padding with it
    byte_model = GPT(CONFIG.replace(vocab_size=256), key=jax.random.key(0))
    full = generate_text(byte_model, ByteTokenizer(), "ab", 20, key=jax.random.key(0), temperature=0.0)[0]
    cut = full[4:6]  # a string that follows the prompt
    text = generate_text(byte_model, ByteTokenizer(), "ab", 20, key=jax.random.key(0), temperature=0.0, stop=[cut])[0]
    assert text == full[: full.index(cut, 2)]
