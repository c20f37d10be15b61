"""Hugging Face checkpoints in and out: GPT-2, Llama and Mixtral weights via safetensors.

The files are those `transformers` writes with `save_pretrained`: `config.json`
and `model.safetensors` (or shards listed in `model.safetensors.index.json`).

Each model family (GPT-2, Llama, Mixtral) is one `Family` (`eqgpt.interop.family`) in the
registry `eqgpt.interop.families.FAMILIES`: its config mapping, tensor map and name prefixes;
this module reads and writes files for any of them.

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
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqgpt.config import GPTConfig
from eqgpt.interop.families import FAMILIES, get_family, register_family
from eqgpt.interop.family import Family, TensorMap
from eqgpt.interop.gpt2 import gpt2_layout
from eqgpt.interop.llama import llama_layout
from eqgpt.interop.mixtral import mixtral_layout
from eqgpt.nn.gpt import GPT

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------ layouts


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


# ------------------------------------------------------------------------------------ configs


def _layout(c: GPTConfig, family: str) -> list[TensorMap]:
    return get_family(family).layout(c)


def _fits(c: GPTConfig, family: str) -> list[str]:
    """What about `c` the `family` layout cannot hold (empty: it fits)."""
    return get_family(family).fits(c)


def family_of(c: GPTConfig) -> str:
    """The name of the first registered family whose Hugging Face layout holds `c`; `ValueError` if none does."""
    for family in FAMILIES:
        if not _fits(c, family):
            return family
    raise ValueError(
        "this model fits no Hugging Face layout eqgpt writes. "
        + "; ".join(f"{f.title}'s cannot hold " + ", ".join(f.fits(c)) for f in FAMILIES.values()) + "."
    )


def _check_fits(c: GPTConfig, family: str) -> None:
    bad = _fits(c, family)
    if bad:
        other = next((f for f in FAMILIES if f != family and not _fits(c, f)), None)
        hint = f" It is {FAMILIES[other].title}-style: use save_hf_{other} (export --format {other})." if other else ""
        raise ValueError(f"{get_family(family).title}'s Hugging Face layout cannot hold this model: "
                         + "; ".join(bad) + "." + hint)


def hf_config(c: GPTConfig, family: str, *, eos_id: int | None = None) -> dict:
    """`config.json` of the `family` (by name) for a `GPTConfig` its layout holds (else `ValueError`)."""
    _check_fits(c, family)
    return get_family(family).to_hf(c, eos_id)


def gpt2_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.GPT2Config` for a GPT-2-shaped `GPTConfig`."""
    return hf_config(c, "gpt2", eos_id=eos_id)


def llama_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.LlamaConfig` for a Llama-shaped `GPTConfig`."""
    return hf_config(c, "llama", eos_id=eos_id)


def mixtral_hf_config(c: GPTConfig, *, eos_id: int | None = None) -> dict:
    """`config.json` of `transformers.MixtralConfig` for a Mixtral-shaped `GPTConfig`."""
    return hf_config(c, "mixtral", eos_id=eos_id)


def config_from_hf(hf: Mapping, where: str = "config.json") -> tuple[GPTConfig, str]:
    """The `GPTConfig` (and layout family) of a Hugging Face `config.json` dict.

    Raises `ValueError` naming the field when the architecture is one eqgpt cannot run.
    """
    kind = hf.get("model_type")
    for family in FAMILIES.values():
        if family.model_type == kind:
            return family.from_hf(hf, where), family.name
    known = [f"{f.title} ({f.model_type!r})" for f in FAMILIES.values()]
    raise ValueError(f"{where}: model_type {kind!r} (architectures {hf.get('architectures')}) is not supported; "
                     f"eqgpt reads {', '.join(known[:-1])} and {known[-1]} checkpoints.")


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


def _prefix(names: set[str], family: str, c: GPTConfig) -> str:
    return get_family(family).prefix(names, c)


def _expected(c: GPTConfig, family: str) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the layout reads."""
    abstract = eqx.filter_eval_shape(GPT, c, key=jax.random.key(0))
    shapes = _leaf_shapes(abstract)
    out: dict[str, tuple[int, ...]] = {}
    layout = _layout(c, family)
    fused: dict[str, int] = {}  # a fused HF tensor's width: the end of its last part (GPT-2's c_attn: 3D)
    for t in layout:
        if t.part is not None:
            fused[t.hf] = max(fused.get(t.hf, 0), t.part[1])
    for t in layout:
        shape = shapes[t.eqgpt][t.stacked:]
        if t.vocab_axis is not None:
            shape = tuple(c.vocab_size if a == t.vocab_axis else n for a, n in enumerate(shape))
        if t.transpose:
            shape = shape[::-1]
        if t.part is not None:
            shape = (*shape[:-1], fused[t.hf])
        for _, name in t.names(c):
            out[name] = shape
    return out


def _leaf_shapes(model) -> dict[str, tuple[int, ...]]:
    from eqgpt.tree import path_str

    return {path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(model)[0]
            if hasattr(x, "shape")}


def check_files(files: SafetensorsFiles, c: GPTConfig, family: str) -> str:
    """Raise `ValueError` for missing, unexpected or wrongly shaped tensors; **returns** the name prefix."""
    names = set(files.tensors)
    prefix = _prefix(names, family, c)
    expected = {get_family(family).file_name(prefix, k): v for k, v in _expected(c, family).items()}
    missing = sorted(set(expected) - names)
    extra = sorted(n for n in names - set(expected)
                   if not n.endswith(get_family(family).ignored)
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


def _reader(files: SafetensorsFiles, t: TensorMap, family: Family, prefix: str, dtype,
            vocab: int) -> Callable[[tuple], np.ndarray]:
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
            name = family.file_name(prefix, t.hf.format(**dict(zip("ij", keys, strict=False))))
            return read_one(name, tuple(index), shape)
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
    family: str | None = None,
) -> tuple[GPTConfig, GPT]:
    """A Hugging Face checkpoint of a registered family (GPT-2, Llama, Mixtral, ...) as an eqgpt `GPT`.

    **Arguments:**

    - `path`: a directory with `config.json` and `model.safetensors` (or shards and
      their index), or the `.safetensors` file (`config.json` beside it).
    - `strategy`: an `eqgpt.parallel.Strategy` to load onto: every array is created in
      its sharding, each device reading only its slice. `None`: the first device.
    - `dtype`: the parameters' dtype (default fp32, whatever the file holds).
    - `config`: the `GPTConfig` the caller expects; a file that differs raises. Its
      `vocab_pad_multiple` is kept: the padding rows of the token table and head are zeros.
    - `family`: a family name (`"gpt2"`, `"llama"`, ...) to insist on one (default: the file's `model_type`).

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
    from eqgpt.tree import path_str

    def make(path_keys, leaf, sharding):
        if not _is_array(leaf):
            return leaf
        name = path_str(path_keys)
        read = _reader(files, maps[name], get_family(fam), prefix, np.dtype(dtype), got.vocab_size)
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
    from eqgpt.tree import path_str

    arrays = eqx.filter(model, eqx.is_array)
    if jax.process_count() > 1:  # arrays span processes: gather them (every process must call)
        from jax.experimental import multihost_utils

        arrays = multihost_utils.process_allgather(arrays, tiled=True)
    return {path_str(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]}


def hf_tensors(model: GPT, family: str | None = None, dtype=np.float32) -> dict[str, np.ndarray]:
    """The model's arrays under their Hugging Face names (fused and transposed as the layout says)."""
    c = model.config
    family = family_of(c) if family is None else family
    _check_fits(c, family)
    arrays = _host_arrays(model)
    out: dict[str, list | np.ndarray] = {}
    for t in _layout(c, family):
        x = arrays[t.eqgpt]
        if t.vocab_axis is not None:  # a padded vocabulary's extra rows are not exported
            x = np.take(x, np.arange(c.vocab_size), axis=t.stacked + t.vocab_axis)
        for keys, hf_name in t.names(c):
            part = x[keys]
            part = part.T if t.transpose else part
            key = get_family(family).export_name(hf_name)
            if t.part is None:
                out[key] = part
            else:
                out.setdefault(key, []).append((t.part[0], part))
    return {k: np.ascontiguousarray(
        np.concatenate([p for _, p in sorted(v, key=lambda e: e[0])], axis=-1) if isinstance(v, list) else v,
        dtype=dtype) for k, v in out.items()}


def save_hf(model: GPT, directory: str | Path, *, tokenizer=None, family: str | None = None,
            dtype=np.float32) -> Path:
    """Write `model` as a Hugging Face checkpoint that `transformers` loads with no missing or
    unexpected keys: `config.json`, `model.safetensors` and, with a `tokenizer`, its
    `tokenizer.json` (+ `tokenizer_config.json`).

    **Arguments:** the `GPT`, the output `directory`, an optional eqgpt `Tokenizer`,
    `family` (`"gpt2"`, `"llama"`, ...; default: the first that holds the model, else `ValueError`),
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
    config = hf_config(c, family, eos_id=eos)
    config["dtype"] = np.dtype(dtype).name
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
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
           "mixtral_layout", "Family", "FAMILIES", "register_family", "get_family", "hf_config"]
