"""Vocabulary padding (`GPTConfig.vocab_pad_multiple`): the token table and head get
`padded_vocab_size` rows, and the extra rows never matter. Each test plants large weights in
them, which would change the loss, draw gradient or be sampled if anything let them through."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import eqgpt
from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.interop import hf as hf_mod
from eqgpt.parallel import Manual, Strategy, make_mesh
from eqgpt.parallel.context import Context, strip_context_attention
from eqgpt.sample import generate
from eqgpt.train import load_model, save_model
from helpers import UnfusedHead

try:  # as tests/test_interop.py: only the tests that need torch skip without it
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="needs torch and transformers, not installed for this Python")

V, MULTIPLE = 20, 64  # 20 ids in 64 rows: over tensor=4, rows 16..31 hold ids and padding, 32..63 padding only
GPT2 = eqgpt.GPTConfig(vocab_size=V, seq_len=16, num_layers=1, num_heads=4, embed_dim=32, init_std=0.2)
LLAMA = eqgpt.preset("llama-nano").replace(vocab_size=V, seq_len=16, num_layers=1, num_heads=4, num_kv_heads=2,
                                           embed_dim=32, mlp_dim=64, init_std=0.2)


def padded_twin(model, rows):
    """`model` with its vocabulary padded to `MULTIPLE`: the same real weights, then `rows` (`[pad, embed]`)
    in the token table and the head."""
    config = model.config.replace(vocab_pad_multiple=MULTIPLE)
    out = eqx.tree_at(lambda m: m.tok_embed.weight, model, jnp.concatenate([model.tok_embed.weight, rows]))
    if model.head is not None:
        out = eqx.tree_at(lambda m: m.head.weight, out, jnp.concatenate([model.head.weight, rows.T], axis=1))
    structure = jax.tree.structure(eqx.filter_eval_shape(nn.GPT, config, key=jax.random.key(0)))
    return jax.tree.unflatten(structure, jax.tree.leaves(out))


def planted(config, scale=30.0):
    """An unpadded model and its padded twin whose padding rows are `scale` times random rows."""
    model = nn.GPT(config, key=jax.random.key(0))
    rows = scale * jax.random.normal(jax.random.key(5), (MULTIPLE - V, config.embed_dim))
    return model, padded_twin(model, rows)


def vocab_grads(grads):
    """The token table's and the head's gradients, each `[rows, embed]`."""
    out = [grads.tok_embed.weight]
    return out if grads.head is None else [*out, grads.head.weight.T]


def assert_padding_is_invisible(plain, padded, rtol=1e-5, atol=1e-6):
    """`(loss, aux), grads` of the padded model equal the plain model's on the real rows; zero on the padding."""
    (loss, aux), grads = plain
    (loss_p, aux_p), grads_p = padded
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-6)
    for k in aux:
        np.testing.assert_allclose(float(aux_p[k]), float(aux[k]), rtol=1e-6)
    for g, g_p in zip(vocab_grads(grads), vocab_grads(grads_p), strict=True):
        assert g_p.shape[0] == MULTIPLE and np.all(np.asarray(g_p)[V:] == 0)
        np.testing.assert_allclose(np.asarray(g_p)[:V], np.asarray(g), rtol=rtol, atol=atol)
    for g, g_p in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p), strict=True):
        if g.shape == g_p.shape:
            np.testing.assert_allclose(np.asarray(g_p), np.asarray(g), rtol=rtol, atol=atol)


def test_padded_size_and_gpt2_presets():
    assert eqgpt.GPTConfig(vocab_size=50257, vocab_pad_multiple=128).padded_vocab_size == 50304
    assert eqgpt.GPTConfig(vocab_size=50257).padded_vocab_size == 50257
    assert eqgpt.GPTConfig(vocab_size=256, vocab_pad_multiple=128).padded_vocab_size == 256
    for name in ("gpt2-small", "gpt2-xl"):
        config = eqgpt.preset(name)
        assert (config.vocab_size, config.padded_vocab_size) == (50257, 50304)
    abstract = eqx.filter_eval_shape(nn.GPT, eqgpt.preset("gpt2-small"), key=jax.random.key(0))
    assert abstract.tok_embed.weight.shape == (50304, 768)
    with pytest.raises(ValueError, match="vocab_pad_multiple must be positive"):
        eqgpt.GPTConfig(vocab_pad_multiple=0)
    # a checkpoint's architecture: unpadded as before the field existed (resumable), padded named
    assert "vocab_pad_multiple" not in eqgpt.preset("nano").architecture()
    assert eqgpt.preset("gpt2-small").architecture()["vocab_pad_multiple"] == 128



@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["tied", "untied"])
def test_loss_and_gradients_equal_the_unpadded_model(config):
    """Both heads of `lm_loss` (fused, and chunked through `GPT.logits`), masked positions, z-loss and a
    sequence that is not a multiple of the chunk: the same loss, the same gradients on the real rows,
    exactly zero gradient on the padding (fp32). The logits a user sees drop the padding."""
    model, twin = planted(config)
    x = jax.random.randint(jax.random.key(1), (3, 12), 0, V)
    y = jax.random.randint(jax.random.key(2), (3, 12), 0, V)
    mask = (jnp.arange(12)[None] < jnp.array([[12], [5], [9]])).astype(jnp.float32)

    @eqx.filter_jit
    def run(m):
        grad = eqx.filter_value_and_grad(
            lambda m: nn.lm_loss(m, x, y, loss_mask=mask, chunk_size=8, z_loss=1e-2), has_aux=True)
        (loss, aux), grads = grad(UnfusedHead(m))
        return grad(m), ((loss, aux), grads.gpt), m(x), m.logits(m.features(x))

    fused, unfused, logits, padded_logits = run(model)
    fused_p, unfused_p, logits_p, padded_logits_p = run(twin)
    assert_padding_is_invisible(fused, fused_p)
    assert_padding_is_invisible(unfused, unfused_p)
    assert logits_p.shape == (3, 12, V) and padded_logits_p.shape == (3, 12, MULTIPLE)
    assert np.all(np.asarray(padded_logits_p)[..., V:] == -np.inf)
    np.testing.assert_allclose(np.asarray(logits_p), np.asarray(logits), rtol=1e-6, atol=1e-6)


MANUAL_TP = Strategy(make_mesh("data=2,tensor=4"), "dp+tp", parts=(Manual(),))  # vocabulary-parallel head


@pytest.mark.parametrize("strategy, config", [
    (MANUAL_TP, GPT2), (MANUAL_TP, LLAMA),
    (Strategy(make_mesh("data=4,context=2"), "dp", parts=(Context("allgather", block=4),)), GPT2),
], ids=["manual-tp-tied", "manual-tp-untied", "context"])
def test_strategies_with_their_own_head_mask_the_padding(strategy, config):
    """The loss paths that do not go through `lm_loss`'s fused head: same loss and gradients as the
    unpadded model on one device; zero gradient on the padding, also on the devices that hold only padding."""
    model, twin = planted(config)
    x = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, V))
    y = np.asarray(jax.random.randint(jax.random.key(2), (8, 16), 0, V))

    def run(strategy, m):
        grad_fn = eqx.filter_jit(strategy.grad_fn(z_loss=1e-2, model_like=m))
        return jax.device_get(grad_fn(strategy.place_model(m), strategy.batch(Batch(x, y))))

    want = run(Strategy(), model)
    got = run(strategy, twin)
    assert_padding_is_invisible(want, (got[0], strip_context_attention(got[1])),
                                rtol=1e-5, atol=1e-6)


def test_sampling_never_returns_a_padding_id():
    """The padding rows are planted so that their logits are the largest at every position (checked
    without the mask); no temperature, top-k or top-p ever samples one."""
    model = nn.GPT(GPT2.replace(vocab_pad_multiple=MULTIPLE), key=jax.random.key(0))
    b = jax.random.normal(jax.random.key(3), (GPT2.embed_dim,))
    model = eqx.tree_at(lambda m: (m.norm.weight, m.norm.bias), model, (jnp.zeros_like(b), b))  # every h is b
    model = eqx.tree_at(lambda m: m.tok_embed.weight, model, model.tok_embed.weight.at[V:].set(10 * b))
    prompt = jnp.zeros((4, 3), jnp.int32)
    raw = model.features(prompt) @ model.head_matrix().T
    assert np.all(np.asarray(jnp.argmax(raw, axis=-1)) >= V)  # unmasked, the padding would win
    for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=100.0, top_k=MULTIPLE - 1),
               dict(temperature=2.0, top_k=3, top_p=0.9)):
        out = np.asarray(generate(model, prompt, 8, key=jax.random.key(4), **kw))
        assert out.max() < V, kw
    assert model(prompt).shape == (4, 3, V)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_hugging_face_import_pads_with_zeros_and_export_drops_the_padding(config, tmp_path):
    """No torch: an unpadded checkpoint loads into a padded config (padding rows zero, the same logits), also
    onto a mesh whose devices hold only padding; the export is the original file, tensor for tensor."""
    model, twin = planted(config)  # twin: the same model, planted padding
    hf_mod.save_hf(model, tmp_path / "plain")
    padded = config.replace(vocab_pad_multiple=MULTIPLE)
    got, loaded = hf_mod.load_hf(tmp_path / "plain", config=padded)
    assert got == padded and loaded.config == padded
    for w, w_plain in zip(vocab_grads(loaded), vocab_grads(model), strict=True):  # the tables, [rows, embed]
        assert w.shape[0] == MULTIPLE and np.all(np.asarray(w)[V:] == 0)
        np.testing.assert_array_equal(np.asarray(w)[:V], np.asarray(w_plain))
    x = jax.random.randint(jax.random.key(1), (2, 16), 0, V)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)

    _, sharded = hf_mod.load_hf(tmp_path / "plain", config=padded,
                                strategy=Strategy(make_mesh("data=2,tensor=4"), "dp+tp"))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    want = load_file(str(tmp_path / "plain" / "model.safetensors"))
    for source, where in ((loaded, "round"), (twin, "planted")):
        hf_mod.save_hf(source, tmp_path / where)
        again = load_file(str(tmp_path / where / "model.safetensors"))
        assert sorted(again) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(again[k], want[k], err_msg=k)
        assert json.loads((tmp_path / where / "config.json").read_text()) == json.loads(
            (tmp_path / "plain" / "config.json").read_text())


def test_saved_model_reloads_with_its_padding(tmp_path):
    _, twin = planted(GPT2)
    save_model(tmp_path, twin)
    again = load_model(tmp_path)
    assert again.config == twin.config and again.config.padded_vocab_size == MULTIPLE
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(twin), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    old = json.loads((tmp_path / "model_config.json").read_text())  # a file written before the field existed
    del old["vocab_pad_multiple"], old["block_factory"]
    assert eqgpt.GPTConfig(**old).padded_vocab_size == V


def hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(torch.tensor(np.asarray(tokens))).logits.numpy()


@needs_hf
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padded_model_logits_equal_transformers_both_ways(family, tmp_path):
    """A transformers model of vocabulary 20 loaded into 64 rows: equal logits; exported, transformers loads
    it with no missing, unexpected or mismatched keys and gives the same logits."""
    torch.manual_seed(0)
    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
            bos_token_id=None, eos_token_id=None))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, initializer_range=0.2, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "in")
    tokens = np.random.default_rng(0).integers(0, V, (2, 16))
    ref = hf_logits(hf, tokens)
    file_config, _ = hf_mod.config_from_hf(hf_mod.SafetensorsFiles(tmp_path / "in").config)
    config, ours = hf_mod.load_hf(tmp_path / "in", config=file_config.replace(vocab_pad_multiple=MULTIPLE))
    assert ours.tok_embed.weight.shape[0] == config.padded_vocab_size == MULTIPLE
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref).max() > 0.1
    hf_mod.save_hf(ours, tmp_path / "out")
    again, info = type(hf).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(hf_logits(again, tokens), ref, atol=1e-4, rtol=1e-4)
