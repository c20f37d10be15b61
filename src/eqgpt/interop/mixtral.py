"""Mixtral (`MixtralForCausalLM`) as a `Family`: Llama's attention and norms with a sparse
MoE feed-forward in every layer.

The router `block_sparse_moe.gate` (`[experts, D]`) is eqgpt's `mlp.router`; expert `j`'s
`w1` (gate), `w3` (up) and `w2` (down) are slice `j` of eqgpt's stacked
`mlp.experts.gate`, `.up` and `.down`, each transposed. Both route alike: softmax over
the experts in fp32, top-k, the k weights renormalised to sum to 1. A loaded Mixtral is
*dropless* (as `transformers` computes every assignment); set a capacity afterwards to
train with one.
"""

from __future__ import annotations

from collections.abc import Mapping

from eqgpt.config import GPTConfig, MoEConfig
from eqgpt.interop.family import Family, TensorMap, require
from eqgpt.interop.llama import SHAPE, llama_layout
from eqgpt.interop.llama import from_hf as llama_from_hf
from eqgpt.interop.llama import to_hf as llama_to_hf


def mixtral_layout(c: GPTConfig) -> list[TensorMap]:
    """The Mixtral names of every array of a Mixtral-shaped `GPTConfig` (Llama's, with an MoE MLP)."""
    moe = "model.layers.{i}.block_sparse_moe"
    out = [t for t in llama_layout(c) if not t.eqgpt.startswith("blocks.mlp.")]
    out.append(TensorMap("blocks.mlp.router.weight", f"{moe}.gate.weight", layered=True, transpose=True))
    out += [TensorMap(f"blocks.mlp.experts.{eq}", f"{moe}.experts.{{j}}.{hf}.weight", layered=True, transpose=True,
                      experts=True) for eq, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]
    return out


def _limits(c: GPTConfig) -> list[str]:
    bad = []
    m = c.moe
    if m is None:
        bad.append("moe=None (every Mixtral layer is MoE)")
    else:
        bad += [f"moe.{k}={getattr(m, k)!r} (Mixtral has {v!r})" for k, v in
                dict(every=1, num_shared=0, renormalize=True).items() if getattr(m, k) != v]
        if m.expert_dim not in (None, c.hidden_dim):
            bad.append(f"moe.expert_dim={m.expert_dim} (Mixtral's experts are intermediate_size = mlp_dim wide)")
    return bad


def _to_hf(c: GPTConfig, eos_id: int | None = None) -> dict:
    llama_config = llama_to_hf(c.replace(moe=None), eos_id=eos_id)
    drop = ("mlp_bias", "attention_bias", "head_dim")
    return {**{k: v for k, v in llama_config.items() if k not in drop},
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "head_dim": c.head_dim,
            "num_local_experts": c.moe.num_experts, "num_experts_per_tok": c.moe.top_k,
            "router_aux_loss_coef": c.moe.aux_loss_weight, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def _from_hf(hf: Mapping, where: str) -> GPTConfig:
    bad = []
    if hf.get("sliding_window") is not None:
        bad.append(f"sliding_window={hf['sliding_window']} (eqgpt reads Mixtral with full causal attention)")
    if hf.get("router_jitter_noise"):
        bad.append(f"router_jitter_noise={hf['router_jitter_noise']} (eqgpt's router has no jitter)")
    if bad:
        raise ValueError(f"{where}: unsupported Mixtral options: " + "; ".join(bad) + ".")
    c = llama_from_hf({**hf, "model_type": "llama"}, where)
    r = lambda k: require(hf, k, where)  # noqa: E731
    moe = MoEConfig(num_experts=r("num_local_experts"), top_k=r("num_experts_per_tok"), dropless=True,
                    renormalize=True, aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)),
                    router_z_weight=0.0)
    return c.replace(moe=moe)


MIXTRAL = Family(name="mixtral", title="Mixtral", model_type="mixtral", layout=mixtral_layout, shape=SHAPE,
                 limits=_limits, to_hf=_to_hf, from_hf=_from_hf)
