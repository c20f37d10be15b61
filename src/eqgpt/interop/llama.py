"""Llama (`LlamaForCausalLM`) as a `Family`: RMSNorm, SwiGLU, RoPE in the rotate-half form
eqgpt uses, grouped kv heads, no biases; every projection is an `nn.Linear` (`[out, in]`),
transposed on the way in and out.
"""

from __future__ import annotations

from collections.abc import Mapping

from eqgpt.config import GPTConfig
from eqgpt.interop.family import Family, TensorMap, require


def llama_layout(c: GPTConfig) -> list[TensorMap]:
    """The Llama names of every array of a Llama-shaped `GPTConfig`."""
    out = [TensorMap("tok_embed.weight", "model.embed_tokens.weight", vocab_axis=0),
           TensorMap("norm.weight", "model.norm.weight")]
    pairs = [("attn_norm.weight", "input_layernorm.weight", False),
             ("mlp_norm.weight", "post_attention_layernorm.weight", False)]
    pairs += [(f"attn.{p}.weight", f"self_attn.{p}.weight", True) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    pairs += [(f"mlp.{eq}.weight", f"mlp.{hf}_proj.weight", True) for eq, hf in (("gate", "gate"), ("up", "up"),
                                                                                 ("down", "down"))]
    out += [TensorMap(f"blocks.{eq}", f"model.layers.{{i}}.{hf}", layered=True, transpose=t) for eq, hf, t in pairs]
    if not c.tie_embeddings:
        out.append(TensorMap("head.weight", "lm_head.weight", transpose=True, vocab_axis=1))
    return out


SHAPE = dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False, mask="causal")


def _limits(c: GPTConfig) -> list[str]:
    return ["moe (MoE layers: Mixtral's layout holds them)"] if c.moe is not None else []


def to_hf(c: GPTConfig, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.LlamaConfig` (unchecked: see `eqgpt.interop.llama_hf_config`)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.embed_dim, "intermediate_size": c.hidden_dim, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.seq_len, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings,
        "initializer_range": c.init_std, "bos_token_id": eos_id, "eos_token_id": eos_id,
        "use_cache": True, "dtype": "float32",
    }


def from_hf(hf: Mapping, where: str) -> GPTConfig:
    """The `GPTConfig` of a Llama `config.json` dict; `ValueError` for options eqgpt cannot run."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    bad = []
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        bad.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} (eqgpt has plain RoPE)")
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf.get('hidden_act')!r} (eqgpt's SwiGLU uses silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        bad.append("attention_bias/mlp_bias (eqgpt's Llama has no biases)")
    r = lambda k: require(hf, k, where)  # noqa: E731
    d, h = r("hidden_size"), r("num_attention_heads")
    if hf.get("head_dim") not in (None, d // h):
        bad.append(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {d // h}")
    if bad:
        raise ValueError(f"{where}: unsupported Llama options: " + "; ".join(bad) + ".")
    return GPTConfig(vocab_size=r("vocab_size"), seq_len=r("max_position_embeddings"),
                     num_layers=r("num_hidden_layers"), num_heads=h, num_kv_heads=hf.get("num_key_value_heads"),
                     embed_dim=d, mlp_dim=r("intermediate_size"), norm="rmsnorm",
                     norm_eps=float(hf.get("rms_norm_eps", 1e-6)), mlp="swiglu", position="rope",
                     rope_theta=theta, use_bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                     init_std=float(hf.get("initializer_range", 0.02)))


LLAMA = Family(name="llama", title="Llama", model_type="llama", layout=llama_layout, shape=SHAPE, limits=_limits,
               to_hf=to_hf, from_hf=from_hf)
