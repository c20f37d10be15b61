"""GPT-2 (`GPT2LMHeadModel`) as a `Family`.

Its `Conv1D` layers store weights `[in, out]`, the transpose of `torch.nn.Linear`;
eqgpt's `Linear` stores `[in, out]` too, so they are copied as they are. The fused
`c_attn` (`[D, 3D]`: queries, keys, values side by side) is split into `q_proj`,
`k_proj`, `v_proj` (and joined again on export). The head is tied to `wte` (GPT-2
saves no `lm_head.weight`); an untied config reads `lm_head.weight` (`[vocab, D]`, an
`nn.Linear`, transposed). Names may carry the `transformer.` prefix (`GPT2LMHeadModel`)
or not (`GPT2Model`, the original files).
"""

from __future__ import annotations

from collections.abc import Mapping

from eqgpt.config import GPTConfig
from eqgpt.interop.family import Family, TensorMap, require


def gpt2_layout(c: GPTConfig) -> list[TensorMap]:
    """The GPT-2 names of every array of a GPT-2-shaped `GPTConfig` (without `transformer.`)."""
    d = c.embed_dim
    out = [TensorMap("tok_embed.weight", "wte.weight", vocab_axis=0), TensorMap("pos_embed.weight", "wpe.weight")]
    for eq, hf in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn.o_proj", "attn.c_proj"),
                   ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
        out += [TensorMap(f"blocks.{eq}.{w}", f"h.{{i}}.{hf}.{w}", layered=True) for w in ("weight", "bias")]
    for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
        out += [TensorMap(f"blocks.attn.{name}.{w}", f"h.{{i}}.attn.c_attn.{w}", layered=True,
                          part=(j * d, (j + 1) * d)) for w in ("weight", "bias")]
    out += [TensorMap("norm.weight", "ln_f.weight"), TensorMap("norm.bias", "ln_f.bias")]
    if not c.tie_embeddings:
        out.append(TensorMap("head.weight", "lm_head.weight", transpose=True, vocab_axis=1))
    return out


def _limits(c: GPTConfig) -> list[str]:
    bad = []
    if c.kv_heads != c.num_heads:
        bad.append(f"num_kv_heads={c.num_kv_heads} (GPT-2 has as many kv heads as query heads)")
    if c.moe is not None:
        bad.append("moe (MoE layers: Mixtral's layout holds them)")
    return bad


def _to_hf(c: GPTConfig, eos_id: int | None = None) -> dict:
    eos = eos_id if eos_id is not None else (50256 if c.vocab_size == 50257 else None)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
        "n_positions": c.seq_len, "n_embd": c.embed_dim, "n_layer": c.num_layers, "n_head": c.num_heads,
        "n_inner": None if c.hidden_dim == 4 * c.embed_dim else c.hidden_dim,
        "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps, "initializer_range": c.init_std,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": c.tie_embeddings, "bos_token_id": eos, "eos_token_id": eos,
        "use_cache": True, "dtype": "float32",
    }


def _from_hf(hf: Mapping, where: str) -> GPTConfig:
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                                "eqgpt's GPT-2 MLP is the tanh GELU ('gelu_new')"),
        "scale_attn_weights": (hf.get("scale_attn_weights", True) is True, "eqgpt scales scores by 1/sqrt(d)"),
        "scale_attn_by_inverse_layer_idx": (not hf.get("scale_attn_by_inverse_layer_idx", False),
                                            "eqgpt does not scale by layer"),
        "add_cross_attention": (not hf.get("add_cross_attention", False), "eqgpt is decoder-only"),
    }
    bad = [f"{k}={hf.get(k)!r} ({why})" for k, (ok, why) in unsupported.items() if not ok]
    if bad:
        raise ValueError(f"{where}: unsupported GPT-2 options: " + "; ".join(bad) + ".")
    r = lambda k: require(hf, k, where)  # noqa: E731
    c = GPTConfig(vocab_size=r("vocab_size"), seq_len=r("n_positions"), num_layers=r("n_layer"),
                  num_heads=r("n_head"), embed_dim=r("n_embd"), mlp_dim=hf.get("n_inner"),
                  norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), mlp="gelu",
                  position="learned", use_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                  init_std=float(hf.get("initializer_range", 0.02)))
    if c.mlp_dim == 4 * c.embed_dim:
        c = c.replace(mlp_dim=None)
    return c


GPT2 = Family(
    name="gpt2", title="GPT-2", model_type="gpt2", layout=gpt2_layout,
    shape=dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True, mask="causal"),
    limits=_limits, to_hf=_to_hf, from_hf=_from_hf,
    prefixes=("transformer.", ""), unprefixed=("lm_head",),
    ignored=(".attn.bias", ".attn.masked_bias"),  # buffers some GPT-2 files carry (causal masks)
)
