"""Hugging Face checkpoints in and out: logits equal `transformers`' own, both ways; sharded loading;
GPT-2 small's names and shapes; clear errors before any array is allocated; the export CLI."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqgpt
from eqgpt.cli import USER_ERROR_EXIT_CODE
from eqgpt.interop import hf as hf_mod
from eqgpt.interop import load_hf, load_hf_gpt2, save_hf_gpt2
from eqgpt.nn import GPT
from eqgpt.parallel import Strategy, make_mesh, param_shardings

try:  # no torch wheel for every Python (CI's newest-JAX leg, 3.12): only the tests that need it skip
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="needs torch and transformers, not installed for this Python")

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 16))


def hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model.eval()(torch.tensor(tokens)).logits.numpy()


def eq_logits(model, tokens=TOKENS):
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))


GPT2_CONFIG = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=4, embed_dim=32, init_std=0.2)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A small random GPT-2 in Hugging Face's layout, written by `save_hf_gpt2` (no torch); its logits
    on TOKENS. `test_gpt2_logits_equal_transformers_both_ways` checks that layout against transformers."""
    model = GPT(GPT2_CONFIG, key=jax.random.key(0))
    path = tmp_path_factory.mktemp("gpt2")
    save_hf_gpt2(model, path)
    return path, eq_logits(model)


@pytest.fixture(scope="module")
def hf_gpt2_dir(tmp_path_factory):
    """A small random GPT2LMHeadModel (no download), saved by transformers; its logits on TOKENS."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config)
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(path)
    return path, hf_logits(model)


def no_allocation(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("an array was allocated before the error")

    monkeypatch.setattr(hf_mod.jax, "make_array_from_callback", fail)


@needs_hf
def test_gpt2_logits_equal_transformers_both_ways(hf_gpt2_dir, tmp_path):
    path, ref = hf_gpt2_dir
    config, model = load_hf_gpt2(path)
    assert config == GPT2_CONFIG
    np.testing.assert_allclose(eq_logits(model), ref, atol=1e-5, rtol=1e-5)
    assert np.abs(ref).max() > 0.1  # not a trivially small comparison

    save_hf_gpt2(model, tmp_path / "export")
    again, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(hf_logits(again), ref, atol=1e-5, rtol=1e-5)


@needs_hf
def test_llama_logits_equal_transformers_both_ways(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      initializer_range=0.2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "in")
    ref = hf_logits(model)
    cfg, ours = load_hf(tmp_path / "in")
    assert (cfg.position, cfg.mlp, cfg.norm, cfg.kv_heads, cfg.use_bias) == ("rope", "swiglu", "rmsnorm", 2, False)
    np.testing.assert_allclose(eq_logits(ours), ref, atol=1e-5, rtol=1e-5)
    hf_mod.save_hf_llama(ours, tmp_path / "out")
    again, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    np.testing.assert_allclose(hf_logits(again), ref, atol=1e-5, rtol=1e-5)


@needs_hf
def test_mixtral_logits_equal_transformers_both_ways(tmp_path):
    """A random Mixtral (4 experts, top-2, GQA): loaded, its logits equal transformers'; exported, it loads
    back with no missing or unexpected keys and the same logits; loaded onto `expert=4,data=2`, each
    device reads its own experts and the logits are the same."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, initializer_range=0.2,
                                        tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(tmp_path / "in")
    ref = hf_logits(model)
    cfg, ours = load_hf(tmp_path / "in")
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.dropless) == (4, 2, True)
    assert (cfg.mlp, cfg.kv_heads, cfg.hidden_dim) == ("swiglu", 2, 48)
    np.testing.assert_allclose(eq_logits(ours), ref, atol=1e-4, rtol=1e-4)
    assert np.abs(ref).max() > 0.1
    hf_mod.save_hf_mixtral(ours, tmp_path / "out")
    again, info = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    np.testing.assert_allclose(hf_logits(again), ref, atol=1e-4, rtol=1e-4)
    rows = np.random.default_rng(1).integers(0, 64, (8, 16))  # one row per device
    _, sharded = load_hf(tmp_path / "in", strategy=Strategy(make_mesh("expert=4,data=2"), "dp"))
    assert sharded.blocks.mlp.experts.up.addressable_shards[0].data.shape[1] == 1  # one expert per device
    np.testing.assert_allclose(eq_logits(sharded, rows), hf_logits(model, rows), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mesh,rules", [("data=2,tensor=4", "dp+tp"), ("fsdp=8", "fsdp")])
def test_sharded_loading_reads_only_each_devices_slice(gpt2_dir, monkeypatch, mesh, rules):
    path, ref = gpt2_dir
    reads = []
    original = hf_mod.SafetensorsFiles.read

    def spy(self, name, index=()):
        out = original(self, name, index)
        reads.append((name, out.size, self.tensors[name][0]))
        return out

    monkeypatch.setattr(hf_mod.SafetensorsFiles, "read", spy)
    strategy = Strategy(make_mesh(mesh), rules)
    config, model = load_hf_gpt2(path, strategy=strategy)
    want = param_shardings(model, strategy.mesh, strategy.param_rules)
    for x, s in zip(jax.tree.leaves(model), jax.tree.leaves(want), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
    n = strategy.mesh.shape["tensor" if "tp" in rules else "fsdp"]
    # the big tensors are split n ways, and no read of them ever took more than a device's slice
    for name in ("transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.attn.c_attn.weight"):
        sizes = [size for nm, size, _ in reads if nm == name]
        full = int(np.prod(next(shape for nm, _, shape in reads if nm == name)))
        assert sizes and max(sizes) * n <= full, (name, sizes, full)
    np.testing.assert_allclose(eq_logits(model), ref, atol=1e-5, rtol=1e-5)


def test_gpt2_small_preset_loads_from_gpt2_small_names_and_shapes(tmp_path):
    """A file laid out as GPT-2 small's (original names, no `transformer.` prefix; random fp16 values)."""
    from safetensors.numpy import save_file

    want = eqgpt.preset("gpt2-small")
    names = hf_mod._expected(want, "gpt2")
    assert names["wte.weight"] == (50257, 768) and names["h.11.attn.c_attn.weight"] == (768, 2304)
    assert len(names) == 2 + 12 * 12 + 2  # wte, wpe, 12 per layer, ln_f weight and bias
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s, np.float32).astype(np.float16) for k, s in names.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**hf_mod.gpt2_hf_config(want), "n_ctx": 1024}))
    del tensors
    config, model = load_hf_gpt2(tmp_path, config=want)
    assert config == want
    ref = eqx.filter_eval_shape(GPT, want, key=jax.random.key(0))
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32
    files = hf_mod.SafetensorsFiles(tmp_path)
    np.testing.assert_array_equal(np.asarray(model.blocks.attn.k_proj.weight[3]),
                                  files.read("h.3.attn.c_attn.weight")[:, 768:1536].astype(np.float32))


def test_errors_come_before_any_allocation(gpt2_dir, tmp_path, monkeypatch):
    path, _ = gpt2_dir
    no_allocation(monkeypatch)
    with pytest.raises(ValueError, match="not found"):
        load_hf_gpt2(tmp_path / "nowhere")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        load_hf_gpt2(tmp_path / "no_weights")
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_config" / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="config.json not found"):
        load_hf_gpt2(tmp_path / "no_config")

    def variant(name, **changes):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        (d / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **changes}))
        return d

    with pytest.raises(ValueError, match=r"wrong shapes: transformer.wte.weight: \(64, 32\) in the file, \(65, 32\)"):
        load_hf_gpt2(variant("shape", vocab_size=65))
    with pytest.raises(ValueError, match="tensors missing: transformer.h.2"):
        load_hf_gpt2(variant("layers", n_layer=3))
    with pytest.raises(ValueError, match="num_layers: 2 in the file, 4 asked for"):
        load_hf_gpt2(path, config=eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=4, num_heads=4, embed_dim=32))
    with pytest.raises(ValueError, match="model_type 'bert'.*not supported"):
        load_hf_gpt2(variant("bert", model_type="bert"))
    with pytest.raises(ValueError, match="activation_function='relu'"):
        load_hf_gpt2(variant("relu", activation_function="relu"))
    with pytest.raises(ValueError, match="holds a gpt2 checkpoint"):
        hf_mod.load_hf_llama(path)
    llama = GPT(eqgpt.preset("llama-nano").replace(num_layers=1, embed_dim=32, mlp_dim=64, vocab_size=64),
                key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"GPT-2's Hugging Face layout cannot hold this model: norm='rmsnorm'.*"
                                         r"position='rope'.*use_bias=False.*num_kv_heads=2.*save_hf_llama"):
        save_hf_gpt2(llama, tmp_path / "never")
    assert not (tmp_path / "never").exists()


@needs_hf
def test_cli_exports_saved_model_and_orbax_checkpoint(tmp_path):
    import optax

    from eqgpt.data import ByteTokenizer
    from eqgpt.interop.__main__ import main as cli
    from eqgpt.train import TrainState, save_model
    from eqgpt.train.checkpoint import Checkpointer

    config = eqgpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, embed_dim=32, init_std=0.2)
    model = GPT(config, key=jax.random.key(1))
    run = tmp_path / "run"
    save_model(run, model)
    ByteTokenizer().save(run)
    (run / "config.json").write_text(json.dumps({"model": config.__dict__}))
    other = GPT(config, key=jax.random.key(2))  # the checkpoint holds a different model than model.eqx
    with Checkpointer(run / "checkpoints", every=1) as ckpt:
        ckpt.save(7, TrainState(other, optax.adam(1e-3).init(eqx_arrays(other)), rng=jax.random.key(0)))
    assert cli(["export", "--run", str(run), "--to", str(tmp_path / "a")]) == 0
    assert cli(["export", "--run", str(run), "--to", str(tmp_path / "b"), "--step", "7"]) == 0
    for out, src in (("a", model), ("b", other)):
        hf, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        tokens = np.random.default_rng(1).integers(0, 256, (2, 16))
        np.testing.assert_allclose(hf_logits(hf, tokens), eq_logits(src, tokens), atol=1e-5, rtol=1e-5)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "a" / "tokenizer.json"))
    assert tok("héllo").input_ids == list("héllo".encode())
    assert cli(["export", "--run", str(run), "--to", str(tmp_path / "c"), "--step", "9"]) == USER_ERROR_EXIT_CODE


def eqx_arrays(model):
    return eqx.filter(model, eqx.is_array)


def test_untied_gpt2_export_loads_back(tmp_path):
    """GPT2LMHeadModel keeps `lm_head.weight` outside `transformer.`: the export writes it there and loading
    finds it there (it once looked for `transformer.lm_head.weight`)."""
    config = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=1, num_heads=4, embed_dim=32, tie_embeddings=False)
    model = GPT(config, key=jax.random.key(0))
    save_hf_gpt2(model, tmp_path)
    assert "lm_head.weight" in hf_mod.SafetensorsFiles(tmp_path).tensors
    loaded_config, loaded = load_hf_gpt2(tmp_path)
    assert loaded_config == config
    np.testing.assert_array_equal(np.asarray(loaded.head.weight), np.asarray(model.head.weight))
