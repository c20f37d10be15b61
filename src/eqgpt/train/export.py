"""Save and load a trained model: Equinox leaves plus the `GPTConfig` as JSON.

The checkpoint module (Orbax, sharded, resumable) will live beside this one; this
is the plain export that `recipes/sample.py` reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import equinox as eqx
import jax

from eqgpt.config import GPTConfig
from eqgpt.nn.gpt import GPT

MODEL_FILE = "model.eqx"
CONFIG_FILE = "model_config.json"


def save_model(out_dir: str | Path, model: GPT) -> Path:
    """Write `model.eqx` (arrays) and `model_config.json` (its `GPTConfig`) into `out_dir`."""
    out = Path(out_dir)
    arrays, static = eqx.partition(model, eqx.is_array)
    if jax.process_count() > 1:  # arrays span processes: every process joins the gather, process 0 writes
        from jax.experimental import multihost_utils

        arrays = multihost_utils.process_allgather(arrays, tiled=True)
        if jax.process_index() != 0:
            return out / MODEL_FILE
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    eqx.tree_serialise_leaves(out / MODEL_FILE, eqx.combine(jax.device_get(arrays), static))
    return out / MODEL_FILE


def load_model(run_dir: str | Path) -> GPT:
    """The `GPT` saved by `save_model` in `run_dir`."""
    run = Path(run_dir)
    for name in (CONFIG_FILE, MODEL_FILE):
        if not (run / name).is_file():
            raise ValueError(f"{run / name} not found; pass the output directory of a finished training run.")
    config = GPTConfig(**json.loads((run / CONFIG_FILE).read_text()))
    skeleton = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    return eqx.tree_deserialise_leaves(run / MODEL_FILE, skeleton)
