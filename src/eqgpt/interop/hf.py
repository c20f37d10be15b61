"""Hugging Face checkpoints in and out: GPT-2, Llama and Mixtral weights via safetensors.

The files are those `transformers` writes with `save_pretrained`: `config.json`
and `model.safetensors` (or shards listed in `model.safetensors.index.json`).

**GPT-2** (`GPT2LMHeadModel`). Its `Conv1D` layers store weights `[in, out]`, the
transpose of `torch.nn.Linear`; eqgpt's `Linear` stores `[in, out]` too, so they are
copied as they are. The fused `c_attn` (`[D, 3D]`: queries, keys, values side by
side) is split into `q_proj`, `k_proj`, `v_proj` (and joined again on export). The
head is tied to `wte` (GPT-2 saves no `lm_head.weight`); an untied config reads
`lm_head.weight` (`[vocab, D]`, an `nn.Linear`, transposed). Names may carry the
`transformer.` prefix (`GPT2LMHeadModel`) or not (`GPT2Model`, the original files).

**Llama** (`LlamaForCausalLM`): RMSNorm, SwiGLU, RoPE in the rotate-half form eqgpt
uses, grouped kv heads, no biases; every projection is an `nn.Linear` (`[out, in]`),
transposed on the way in and out.

**Mixtral** (`MixtralForCausalLM`): Llama's attention and norms with a sparse MoE
feed-forward in every layer. The router `block_sparse_moe.gate` (`[experts, D]`)
is eqgpt's `mlp.router`; expert `j`'s `w1` (gate), `w3` (up) and `w2` (down) are
slice `j` of eqgpt's stacked `mlp.experts.gate`, `.up` and `.down`, each
transposed. Both route alike: softmax over the experts in fp32, top-k, the k
weights renormalised to sum to 1. A loaded Mixtral is *dropless* (as
`transformers` computes every assignment); set a capacity afterwards to train with one.

Everything about a file is checked from its JSON config and the safetensors
headers *before* any array is allocated: missing files, an architecture eqgpt
cannot represent, missing, unexpected or wrongly shaped tensors, and a config that
differs from the one asked for each raise `ValueError` saying what to do.

Loading onto a mesh (`strategy=`) creates every array directly in its sharding
with `jax.make_array_from_callback`: each device's callback reads only its own
slice from the memory-mapped file, so no device (and no host buffer) ever holds a
whole copy of a sharded weight.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqgpt.config import GPTConfig
from eqgpt.nn.gpt import GPT

Family = Literal["gpt2", "llama", "mixtral"]
FAMILIES: tuple[Family, ...] = ("gpt2", "llama", "mixtral")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some GPT-2 files carry (causal masks), not parameters: ignored.
_GPT2_BUFFERS = (".attn.bias", ".attn.masked_bias")


# ------------------------------------------------------------------------------------ layouts


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one eqgpt array relates to one Hugging Face tensor.

    **Fields:** `eqgpt` (dotted path in the `GPT`, e.g. `blocks.attn.q_proj.weight`),
    `hf` (the tensor name, `{i}` standing for the layer), `layered` (one HF tensor per
    layer, stacked on eqgpt's leading `layers` axis), `part` (`(start, stop)` along the
    HF tensor's last axis: the slice of a fused tensor), `transpose` (HF stores the
    transpose: `nn.Linear`'s `[out, in]`), `experts` (one HF tensor per expert too,
    `{j}` in the name, stacked on eqgpt's `experts` axis after the layers), `vocab_axis`
    (eqgpt's axis of the vocabulary, after the stacked ones: `padded_vocab_size` long in
    eqgpt, `vocab_size` in the file; the padding rows load as zeros and are not exported).
    """

    eqgpt: str
    hf: str
    layered: bool = False
    part: tuple[int, int] | None = None
    transpose: bool = False
    experts: bool = False
    vocab_axis: int | None = None

    @property
    def stacked(self) -> int:
        """Leading eqgpt axes that index HF tensors (layers, experts) rather than their elements."""
        return int(self.layered) + int(self.experts)

    def names(self, c: GPTConfig) -> list[tuple[tuple[int, ...], str]]:
        """`(index on the stacked axes, HF name)` of every HF tensor this array spans."""
        layers = range(c.num_layers) if self.layered else [None]
        experts = range(c.moe.num_experts) if self.experts else [None]
        return [(tuple(k for k in (i, j) if k is not None), self.hf.format(i=i, j=j)) for i in layers for j in experts]


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


def mixtral_layout(c: GPTConfig) -> list[TensorMap]:
    """The Mixtral names of every array of a Mixtral-shaped `GPTConfig` (Llama's, with an MoE MLP)."""
    moe = "model.layers.{i}.block_sparse_moe"
    out = [t for t in llama_layout(c) if not t.eqgpt.startswith("blocks.mlp.")]
    out.append(TensorMap("blocks.mlp.router.weight", f"{moe}.gate.weight", layered=True, transpose=True))
    out += [TensorMap(f"blocks.mlp.experts.{eq}", f"{moe}.experts.{{j}}.{hf}.weight", layered=True, transpose=True,
                      experts=True) for eq, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]
    return out


def _layout(c: GPTConfig, family: Family) -> list[TensorMap]:
    return {"gpt2": gpt2_layout, "llama": llama_layout, "mixtral": mixtral_layout}[family](c)


# ------------------------------------------------------------------------------------ configs


def _fits(c: GPTConfig, family: Family) -> list[str]:
    """What about `c` the `family` layout cannot hold (empty: it fits)."""
    want = (dict(norm="layernorm", mlp="gelu", position="learned", use_bias=True, mask="causal")
            if family == "gpt2" else dict(norm="rmsnorm", mlp="swiglu", position="rope", use_bias=False,
                                          mask="causal"))
    bad = [f"{k}={getattr(c, k)!r} (it has {v!r})" for k, v in want.items() if getattr(c, k) != v]
    if family == "gpt2" and c.kv_heads != c.num_heads:
        bad.append(f"num_kv_heads={c.num_kv_heads} (GPT-2 has as many kv heads as query heads)")
    if family != "mixtral" and c.moe is not None:
        bad.append("moe (MoE layers: Mixtral's layout holds them)")
    if family == "mixtral":
        m = c.moe
        if m is None:
            bad.append("moe=None (every Mixtral layer is MoE)")
        else:
            bad += [f"moe.{k}={getattr(m, k)!r} (Mixtral has {v!r})" for k, v in
                    dict(every=1, num_shared=0, renormalize=True).items() if getattr(m, k) != v]
            if m.expert_dim not in (None, c.hidden_dim):
                bad.append(f"moe.expert_dim={m.expert_dim} (Mixtral's experts are intermediate_size = mlp_dim wide)")
    return bad


def family_of(c: GPTConfig) -> Family:
    """`"gpt2"` or `"llama"`: the Hugging Face layout that holds `c`; `ValueError` if neither does."""
    for family in FAMILIES:
        if not _fits(c, family):
            return family
    raise ValueError(
        "this model fits no Hugging Face layout eqgpt writes. "
        + "; ".join(f"{_NAMES[f]}'s cannot hold " + ", ".join(_fits(c, f)) for f in FAMILIES) + "."
    )


_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "mixtral": "Mixtral"}


def _check_fits(c: GPTConfig, family: Family) -> None:
    bad = _fits(c, family)
    if bad:
        other = next((f for f in FAMILIES if f != family and not _fits(c, f)), None)
        hint = f" It is {_NAMES[other]}-style: use save_hf_{other} (export --format {other})." if other else ""
        raise ValueError(f"{_NAMES[family]}'s Hugging Face layout cannot hold this model: " + "; ".join(bad) + "."
                         + hint)


def gpt2_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.GPT2Config` for a GPT-2-shaped `GPTConfig`."""
    _check_fits(c, "gpt2")
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


def llama_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.LlamaConfig` for a Llama-shaped `GPTConfig`."""
    _check_fits(c, "llama")
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


def mixtral_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.MixtralConfig` for a Mixtral-shaped `GPTConfig`."""
    _check_fits(c, "mixtral")
    llama = llama_hf_config(c.replace(moe=None), eos_id=eos_id)
    drop = ("mlp_bias", "attention_bias", "head_dim")
    return {**{k: v for k, v in llama.items() if k not in drop},
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "head_dim": c.head_dim,
            "num_local_experts": c.moe.num_experts, "num_experts_per_tok": c.moe.top_k,
            "router_aux_loss_coef": c.moe.aux_loss_weight, "output_router_logits": False,
            "router_jitter_noise": 0.0, "sliding_window": None}


def _require(hf: Mapping, key: str, where: str) -> Any:
    if hf.get(key) is None:
        raise ValueError(f"{where} has no {key!r}; it is not a complete Hugging Face config.")
    return hf[key]


def config_from_hf(hf: Mapping, where: str = "config.json") -> tuple[GPTConfig, Family]:
    """The `GPTConfig` (and layout family) of a Hugging Face `config.json` dict.

    Raises `ValueError` naming the field when the architecture is one eqgpt cannot run.
    """
    kind = hf.get("model_type")
    if kind == "gpt2":
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
        r = lambda k: _require(hf, k, where)  # noqa: E731
        c = GPTConfig(vocab_size=r("vocab_size"), seq_len=r("n_positions"), num_layers=r("n_layer"),
                      num_heads=r("n_head"), embed_dim=r("n_embd"), mlp_dim=hf.get("n_inner"),
                      norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), mlp="gelu",
                      position="learned", use_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                      init_std=float(hf.get("initializer_range", 0.02)))
        if c.mlp_dim == 4 * c.embed_dim:
            c = c.replace(mlp_dim=None)
        return c, "gpt2"
    if kind == "mixtral":
        bad = []
        if hf.get("sliding_window") is not None:
            bad.append(f"sliding_window={hf['sliding_window']} (eqgpt reads Mixtral with full causal attention)")
        if hf.get("router_jitter_noise"):
            bad.append(f"router_jitter_noise={hf['router_jitter_noise']} (eqgpt's router has no jitter)")
        if bad:
            raise ValueError(f"{where}: unsupported Mixtral options: " + "; ".join(bad) + ".")
        c, _ = config_from_hf({**hf, "model_type": "llama"}, where)
        from eqgpt.config import MoEConfig

        r = lambda k: _require(hf, k, where)  # noqa: E731
        moe = MoEConfig(num_experts=r("num_local_experts"), top_k=r("num_experts_per_tok"), dropless=True,
                        renormalize=True, aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)),
                        router_z_weight=0.0)
        return c.replace(moe=moe), "mixtral"
    if kind == "llama":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        bad = []
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            bad.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} (eqgpt has plain RoPE)")
        if hf.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={hf.get('hidden_act')!r} (eqgpt's SwiGLU uses silu)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            bad.append("attention_bias/mlp_bias (eqgpt's Llama has no biases)")
        r = lambda k: _require(hf, k, where)  # noqa: E731
        d, h = r("hidden_size"), r("num_attention_heads")
        if hf.get("head_dim") not in (None, d // h):
            bad.append(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {d // h}")
        if bad:
            raise ValueError(f"{where}: unsupported Llama options: " + "; ".join(bad) + ".")
        c = GPTConfig(vocab_size=r("vocab_size"), seq_len=r("max_position_embeddings"),
                      num_layers=r("num_hidden_layers"), num_heads=h, num_kv_heads=hf.get("num_key_value_heads"),
                      embed_dim=d, mlp_dim=r("intermediate_size"), norm="rmsnorm",
                      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), mlp="swiglu", position="rope",
                      rope_theta=theta, use_bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                      init_std=float(hf.get("initializer_range", 0.02)))
        return c, "llama"
    raise ValueError(f"{where}: model_type {kind!r} (architectures {hf.get('architectures')}) is not supported; "
                     "eqgpt reads GPT-2 ('gpt2'), Llama ('llama') and Mixtral ('mixtral') checkpoints.")


# ------------------------------------------------------------------------------------ files


class SafetensorsFiles:
    """The tensors of one checkpoint (one file or index-listed shards), read lazily by slice.

    **Arguments:** `path`: a directory with `config.json` + `model.safetensors` (or an
    index), or the `.safetensors` file itself (`config.json` beside it).
    """

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path).expanduser()
        if path.is_file():
            directory, files = path.parent, [path]
        elif path.is_dir():
            directory = path
            if (path / WEIGHTS_FILE).is_file():
                files = [path / WEIGHTS_FILE]
            elif (path / INDEX_FILE).is_file():
                index = json.loads((path / INDEX_FILE).read_text())
                files = [path / f for f in sorted(set(index.get("weight_map", {}).values()))]
                missing = [str(f) for f in files if not f.is_file()]
                if missing:
                    raise ValueError(f"{path / INDEX_FILE} lists shard files that are missing: {missing}.")
            else:
                raise ValueError(f"{path} holds no {WEIGHTS_FILE} (nor {INDEX_FILE}); save the model with "
                                 "save_pretrained(..., safe_serialization=True) or pass the .safetensors file.")
        else:
            raise ValueError(f"{path} not found; pass a directory holding {CONFIG_FILE} and {WEIGHTS_FILE}.")
        if not (directory / CONFIG_FILE).is_file():
            raise ValueError(f"{directory / CONFIG_FILE} not found: the model's shapes come from it; copy the "
                             f"{CONFIG_FILE} saved with the weights next to them.")
        self.directory = directory
        self.config = json.loads((directory / CONFIG_FILE).read_text())
        self._handles = []
        self.tensors: dict[str, tuple[tuple[int, ...], str, Any]] = {}  # name -> (shape, dtype, handle)
        for f in files:
            try:
                h = safe_open(str(f), framework="numpy")
            except Exception as e:  # noqa: BLE001 - a damaged or foreign file
                raise ValueError(f"{f} is not a readable safetensors file: {e}") from e
            self._handles.append(h)
            for name in h.keys():
                s = h.get_slice(name)
                self.tensors[name] = (tuple(s.get_shape()), s.get_dtype(), h)
        self.reads: list[tuple[str, tuple[int, ...]]] = []  # (name, shape read): what loading touched

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """`tensor[index]`, reading only that slice from the file."""
        handle = self.tensors[name][2]
        part = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        part = np.asarray(part)
        self.reads.append((name, part.shape))
        return part


# ------------------------------------------------------------------------------------ loading


def _prefix(names: set[str], family: Family) -> str:
    if family == "gpt2":
        return "transformer." if "transformer.wte.weight" in names else ""
    return ""


def _expected(c: GPTConfig, family: Family) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the layout reads."""
    abstract = eqx.filter_eval_shape(GPT, c, key=jax.random.key(0))
    shapes = _leaf_shapes(abstract)
    out: dict[str, tuple[int, ...]] = {}
    for t in _layout(c, family):
        shape = shapes[t.eqgpt][t.stacked:]
        if t.vocab_axis is not None:
            shape = tuple(c.vocab_size if a == t.vocab_axis else n for a, n in enumerate(shape))
        if t.transpose:
            shape = shape[::-1]
        if t.part is not None:
            total = 3 * shape[-1]  # fused q/k/v (GPT-2's c_attn)
            shape = (*shape[:-1], total)
        for _, name in t.names(c):
            out[name] = shape
    return out


def _leaf_shapes(model) -> dict[str, tuple[int, ...]]:
    from eqgpt.parallel.auto import path_str

    return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(model)[0]
            if hasattr(x, "shape")}


def check_files(files: SafetensorsFiles, c: GPTConfig, family: Family) -> str:
    """Raise `ValueError` for missing, unexpected or wrongly shaped tensors; **returns** the name prefix."""
    names = set(files.tensors)
    prefix = _prefix(names, family)
    expected = {prefix + k: v for k, v in _expected(c, family).items()}
    missing = sorted(set(expected) - names)
    extra = sorted(n for n in names - set(expected)
                   if not (family == "gpt2" and n.endswith(_GPT2_BUFFERS))
                   and not (n == "lm_head.weight" and c.tie_embeddings))
    wrong = [f"{n}: {files.tensors[n][0]} in the file, {s} for the config" for n, s in expected.items()
             if n in names and files.tensors[n][0] != s]
    problems = []
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
    if missing:
        problems.append(f"{len(missing)} tensors missing: " + ", ".join(missing[:5])
                        + (" ..." if len(missing) > 5 else ""))
    if extra:
        problems.append(f"{len(extra)} unexpected tensors: " + ", ".join(extra[:5])
                        + (" ..." if len(extra) > 5 else ""))
    if problems:
        raise ValueError(f"the weights in {files.directory} do not fit its {CONFIG_FILE} "
                         f"({family}, {c.num_layers} layers x {c.embed_dim} wide, vocab {c.vocab_size}): "
                         + "; ".join(problems) + ". Use the config.json saved with these weights.")
    return prefix


def _config_mismatch(want: GPTConfig, got: GPTConfig) -> list[str]:
    skip = {"attention_kernel", "remat", "init_std", "window", "vocab_pad_multiple"}
    return [f"{f.name}: {getattr(got, f.name)!r} in the file, {getattr(want, f.name)!r} asked for"
            for f in dataclasses.fields(GPTConfig)
            if f.name not in skip and getattr(got, f.name) != getattr(want, f.name)]


def _reader(files: SafetensorsFiles, t: TensorMap, prefix: str, dtype, vocab: int) -> Callable[[tuple], np.ndarray]:
    """`index -> array`: the eqgpt array's slice `index`, read slice by slice from the HF tensors
    (a padded vocabulary's rows from `vocab` on are zeros)."""

    def hf_index(idx: tuple[slice, ...]) -> tuple[slice, ...]:
        if t.transpose:
            idx = idx[::-1]
        if t.part is not None:  # the eqgpt array is columns part[0]:part[1] of the HF tensor
            last = idx[-1]
            idx = (*idx[:-1], slice(t.part[0] + last.start, t.part[0] + last.stop))
        return idx

    def read_one(name: str, idx: tuple[slice, ...], shape: tuple[int, ...]) -> np.ndarray:
        idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
        idx = tuple(slice(*s.indices(n)) for s, n in zip(idx, shape, strict=True))
        a = t.vocab_axis
        if a is None or idx[a].stop <= vocab:
            x = files.read(name, hf_index(idx))
            return np.asarray(x.T if t.transpose else x, dtype)
        out = np.zeros([s.stop - s.start for s in idx], dtype)  # the padding rows
        if idx[a].start < vocab:
            real = (*idx[:a], slice(idx[a].start, vocab), *idx[a + 1:])
            out[(slice(None),) * a + (slice(0, vocab - idx[a].start),)] = read_one(name, real, shape)
        return out

    def callback(index: tuple[slice, ...], shape: tuple[int, ...], keys: tuple[int, ...] = ()) -> np.ndarray:
        if len(keys) == t.stacked:  # one HF tensor (its layer and expert, if any, are `keys`)
            return read_one(prefix + t.hf.format(**dict(zip("ij", keys, strict=False))), tuple(index), shape)
        rows = range(shape[0])[index[0] if index else slice(None)]
        return np.stack([callback(tuple(index[1:]), shape[1:], (*keys, k)) for k in rows])

    return callback


def _target_shardings(abstract: GPT, strategy) -> Any:
    if strategy is None or strategy.mesh is None:
        device = jax.devices()[0] if strategy is None else strategy.placement_for(abstract).device
        s = jax.sharding.SingleDeviceSharding(device)
        return jax.tree.map(lambda _: s, eqx.filter(abstract, _is_array))
    from eqgpt.parallel.auto import param_shardings

    return param_shardings(eqx.filter(abstract, _is_array), strategy.mesh, strategy.param_rules,
                           strategy.overrides)


def load_hf(
    path: str | Path,
    *,
    strategy=None,
    dtype=jnp.float32,
    config: GPTConfig | None = None,
    family: Family | None = None,
) -> tuple[GPTConfig, GPT]:
    """A Hugging Face GPT-2 or Llama checkpoint as an eqgpt `GPT`.

    **Arguments:**

    - `path`: a directory with `config.json` and `model.safetensors` (or shards and
      their index), or the `.safetensors` file (`config.json` beside it).
    - `strategy`: an `eqgpt.parallel.Strategy` to load onto: every array is created in
      its sharding, each device reading only its slice. `None`: the first device.
    - `dtype`: the parameters' dtype (default fp32, whatever the file holds).
    - `config`: the `GPTConfig` the caller expects; a file that differs raises. Its
      `vocab_pad_multiple` is kept: the padding rows of the token table and head are zeros.
    - `family`: `"gpt2"` or `"llama"` to insist on one (default: the file's `model_type`).

    **Returns:** `(config, model)`; the config's `attention_kernel`, `remat` and
    `vocab_pad_multiple` are `config`'s when given.
    """
    files = SafetensorsFiles(path)
    got, fam = config_from_hf(files.config, str(files.directory / CONFIG_FILE))
    if family is not None and fam != family:
        raise ValueError(f"{files.directory} holds a {fam} checkpoint (model_type {files.config.get('model_type')!r}),"
                         f" not {family}; use load_hf_{fam} or load_hf.")
    if config is not None:
        diff = _config_mismatch(config, got)
        if diff:
            raise ValueError(f"{files.directory / CONFIG_FILE} does not match the config asked for: "
                             + "; ".join(diff) + ". Load without config= to take the file's, or fix the config.")
        got = got.replace(attention_kernel=config.attention_kernel, remat=config.remat,
                          vocab_pad_multiple=config.vocab_pad_multiple)
    prefix = check_files(files, got, fam)  # everything checked: now allocate
    abstract = eqx.filter_eval_shape(GPT, got, key=jax.random.key(0))
    shardings = _target_shardings(abstract, strategy)
    maps = {t.eqgpt: t for t in _layout(got, fam)}
    from eqgpt.parallel.auto import path_str

    def make(path_keys, leaf, sharding):
        if not _is_array(leaf):
            return leaf
        name = path_str(path_keys)
        read = _reader(files, maps[name], prefix, np.dtype(dtype), got.vocab_size)
        shape = tuple(leaf.shape)
        return jax.make_array_from_callback(shape, sharding, lambda idx: read(idx, shape))

    arrays, static = eqx.partition(abstract, _is_array)
    arrays = jax.tree_util.tree_map_with_path(make, arrays, shardings)
    model = eqx.combine(arrays, static)
    if strategy is not None and strategy.mesh is not None:
        model = strategy.place_model(model)  # activation constraints; arrays already where they belong
    return got, model


def load_hf_gpt2(path: str | Path, *, strategy=None, dtype=jnp.float32,
                 config: GPTConfig | None = None) -> tuple[GPTConfig, GPT]:
    """A `transformers` `GPT2LMHeadModel` checkpoint as an eqgpt `GPT` (see `load_hf`)."""
    return load_hf(path, strategy=strategy, dtype=dtype, config=config, family="gpt2")


def load_hf_llama(path: str | Path, *, strategy=None, dtype=jnp.float32,
                  config: GPTConfig | None = None) -> tuple[GPTConfig, GPT]:
    """A `transformers` `LlamaForCausalLM` checkpoint as an eqgpt `GPT` (see `load_hf`)."""
    return load_hf(path, strategy=strategy, dtype=dtype, config=config, family="llama")


# ------------------------------------------------------------------------------------ saving


def _host_arrays(model: GPT) -> dict[str, np.ndarray]:
    from eqgpt.parallel.auto import path_str

    arrays = eqx.filter(model, eqx.is_array)
    if jax.process_count() > 1:  # arrays span processes: gather them (every process must call)
        from jax.experimental import multihost_utils

        arrays = multihost_utils.process_allgather(arrays, tiled=True)
    return {path_str(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]}


def hf_tensors(model: GPT, family: Family | None = None, dtype=np.float32) -> dict[str, np.ndarray]:
    """The model's arrays under their Hugging Face names (fused and transposed as the layout says)."""
    c = model.config
    family = family_of(c) if family is None else family
    _check_fits(c, family)
    arrays = _host_arrays(model)
    out: dict[str, list | np.ndarray] = {}
    prefix = "transformer." if family == "gpt2" else ""
    for t in _layout(c, family):
        x = arrays[t.eqgpt]
        if t.vocab_axis is not None:  # a padded vocabulary's extra rows are not exported
            x = np.take(x, np.arange(c.vocab_size), axis=t.stacked + t.vocab_axis)
        for keys, hf_name in t.names(c):
            part = x[keys]
            part = part.T if t.transpose else part
            key = hf_name if hf_name.startswith("lm_head") else prefix + hf_name
            if t.part is None:
                out[key] = part
            else:
                out.setdefault(key, []).append((t.part[0], part))
    return {k: np.ascontiguousarray(
        np.concatenate([p for _, p in sorted(v, key=lambda e: e[0])], axis=-1) if isinstance(v, list) else v,
        dtype=dtype) for k, v in out.items()}


def save_hf(model: GPT, directory: str | Path, *, tokenizer=None, family: Family | None = None,
            dtype=np.float32) -> Path:
    """Write `model` as a Hugging Face checkpoint that `transformers` loads with no missing or
    unexpected keys: `config.json`, `model.safetensors` and, with a `tokenizer`, its
    `tokenizer.json` (+ `tokenizer_config.json`).

    **Arguments:** the `GPT`, the output `directory`, an optional eqgpt `Tokenizer`,
    `family` (`"gpt2"`/`"llama"`; default: whichever holds the model, else `ValueError`),
    `dtype` of the stored weights.

    **Returns:** the path of `model.safetensors`. With several processes every process
    must call it (the arrays are gathered); process 0 writes.
    """
    from safetensors.numpy import save_file

    c = model.config
    family = family_of(c) if family is None else family
    _check_fits(c, family)
    tensors = hf_tensors(model, family, dtype)
    out = Path(directory)
    if jax.process_index() != 0:
        return out / WEIGHTS_FILE
    out.mkdir(parents=True, exist_ok=True)
    eos = None if tokenizer is None else tokenizer.eos_id
    hf_config = {"gpt2": gpt2_hf_config, "llama": llama_hf_config, "mixtral": mixtral_hf_config}[family](c, eos_id=eos)
    hf_config["dtype"] = np.dtype(dtype).name
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2))
    if tokenizer is not None:
        tokenizer.save(out)
        special = {v: k for k, v in tokenizer.special_tokens.items()}
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": c.seq_len,
                      "clean_up_tokenization_spaces": False}
        if eos is not None:
            tok_config.update(eos_token=special.get(eos), bos_token=special.get(eos))
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out / WEIGHTS_FILE


def save_hf_gpt2(model: GPT, directory: str | Path, *, tokenizer=None, dtype=np.float32) -> Path:
    """Write a GPT-2-shaped `model` as a `GPT2LMHeadModel` checkpoint (see `save_hf`).

    A model GPT-2's layout cannot hold (RoPE, SwiGLU, RMSNorm, no biases, GQA, sliding
    window) raises `ValueError` naming each difference.
    """
    return save_hf(model, directory, tokenizer=tokenizer, family="gpt2", dtype=dtype)


def save_hf_llama(model: GPT, directory: str | Path, *, tokenizer=None, dtype=np.float32) -> Path:
    """Write a Llama-shaped `model` as a `LlamaForCausalLM` checkpoint (see `save_hf`)."""
    return save_hf(model, directory, tokenizer=tokenizer, family="llama", dtype=dtype)


def load_hf_mixtral(path: str | Path, *, strategy=None, dtype=jnp.float32,
                    config: GPTConfig | None = None) -> tuple[GPTConfig, GPT]:
    """A `transformers` `MixtralForCausalLM` checkpoint as an eqgpt `GPT` with MoE layers (see `load_hf`)."""
    return load_hf(path, strategy=strategy, dtype=dtype, config=config, family="mixtral")


def save_hf_mixtral(model: GPT, directory: str | Path, *, tokenizer=None, dtype=np.float32) -> Path:
    """Write a Mixtral-shaped `model` (Llama-style, MoE in every layer) as a `MixtralForCausalLM` checkpoint."""
    return save_hf(model, directory, tokenizer=tokenizer, family="mixtral", dtype=dtype)


__all__ = ["load_hf", "load_hf_gpt2", "load_hf_llama", "load_hf_mixtral", "save_hf", "save_hf_gpt2", "save_hf_llama",
           "save_hf_mixtral", "config_from_hf", "gpt2_hf_config", "llama_hf_config", "mixtral_hf_config", "family_of",
           "hf_tensors", "check_files", "SafetensorsFiles", "TensorMap", "gpt2_layout", "llama_layout",
           "mixtral_layout"]
