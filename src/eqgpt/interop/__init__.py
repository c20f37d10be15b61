"""Models in and out of eqgpt: Hugging Face GPT-2, Llama and Mixtral checkpoints (safetensors).

- `load_hf_gpt2(path) -> (GPTConfig, GPT)`, `load_hf_llama`, `load_hf_mixtral`, `load_hf` (any, by
  `model_type`); `strategy=` loads straight onto a mesh, each device reading its slice.
- `save_hf_gpt2(model, dir)`, `save_hf_llama`, `save_hf_mixtral`, `save_hf`: files `transformers` loads.
- `Family`, `FAMILIES`, `register_family`: one object per model family (config mapping, tensor map,
  name prefixes); adding a family means adding one.
- `python -m eqgpt.interop export --run runs/latest --to out/hf`: a training run's saved
  model (or its latest Orbax checkpoint) and tokenizer as a Hugging Face directory;
  `python -m eqgpt.interop import --from hf_dir --to runs/gpt2`: the reverse.

See `docs/interop.md`.
"""

from eqgpt.interop.hf import (
    FAMILIES,
    Family,
    SafetensorsFiles,
    TensorMap,
    check_files,
    config_from_hf,
    family_of,
    gpt2_hf_config,
    gpt2_layout,
    hf_tensors,
    llama_hf_config,
    llama_layout,
    load_hf,
    load_hf_gpt2,
    load_hf_llama,
    load_hf_mixtral,
    mixtral_hf_config,
    mixtral_layout,
    register_family,
    save_hf,
    save_hf_gpt2,
    save_hf_llama,
    save_hf_mixtral,
)

__all__ = [
    "load_hf", "load_hf_gpt2", "load_hf_llama", "save_hf", "save_hf_gpt2", "save_hf_llama", "config_from_hf",
    "gpt2_hf_config", "llama_hf_config", "family_of", "hf_tensors", "check_files", "SafetensorsFiles",
    "TensorMap", "gpt2_layout", "llama_layout", "load_hf_mixtral", "save_hf_mixtral", "mixtral_hf_config",
    "mixtral_layout", "Family", "FAMILIES", "register_family",
]
