"""Save and load a trained model: Equinox leaves plus the `GPTConfig` as JSON.

The checkpoint module (Orbax, sharded, resumable) will live beside this one; this
is the plain export that `recipes/sample.py` reads.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax

from eqgpt.config import GPTConfig
from eqgpt.nn.factory import DEFAULT_BLOCK, factory_path, get_block
from eqgpt.nn.gpt import GPT
from eqgpt.nn.kernels import kernel_names

MODEL_FILE = "model.eqx"
CONFIG_FILE = "model_config.json"
BLOCK_KEY = "block_factory"  # model_config.json: the `module:name` that built the layers


def save_model(out_dir: str | Path, model: GPT) -> Path:
    """Write `model.eqx` (arrays) and `model_config.json` (its `GPTConfig`, with the attention kernel
    and the block factory's `module:name` under `block_factory`) into `out_dir`."""
    out = Path(out_dir)
    arrays, static = eqx.partition(model, eqx.is_array)
    if jax.process_count() > 1:  # arrays span processes: every process joins the gather, process 0 writes
        from jax.experimental import multihost_utils

        arrays = multihost_utils.process_allgather(arrays, tiled=True)
        if jax.process_index() != 0:
            return out / MODEL_FILE
    out.mkdir(parents=True, exist_ok=True)
    record = {**dataclasses.asdict(model.config), BLOCK_KEY: model.block_factory_path}
    (out / CONFIG_FILE).write_text(json.dumps(record, indent=2))
    eqx.tree_serialise_leaves(out / MODEL_FILE, eqx.combine(jax.device_get(arrays), static))
    return out / MODEL_FILE


def config_from_record(record: dict) -> tuple[GPTConfig, str]:
    """The `GPTConfig` and the block factory's name of a `model_config.json` record."""
    record = dict(record)
    block = record.pop(BLOCK_KEY, DEFAULT_BLOCK)
    return GPTConfig(**record), block


def usable_kernel(config: GPTConfig, *, note=None) -> GPTConfig:
    """`config`, its attention kernel replaced by `reference` (with a `note`) if not registered here."""
    if config.attention_kernel in kernel_names():
        return config
    (note or _note)(f"note: attention kernel {config.attention_kernel!r} is not registered here; using "
                    "'reference' (same parameters; --import the package that registers it to use it)")
    return config.replace(attention_kernel="reference")


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_model(run_dir: str | Path, *, block_factory: str | Callable | None = None, note=None) -> GPT:
    """The `GPT` saved by `save_model` in `run_dir`.

    Its layers are built by `block_factory` (a callable, a registered name or `module:name`),
    by default the one `model_config.json` records, imported by name. A kernel not registered
    in this process runs as `reference`, with a one-line `note` (default: to stderr).
    """
    run = Path(run_dir)
    for name in (CONFIG_FILE, MODEL_FILE):
        if not (run / name).is_file():
            raise ValueError(f"{run / name} not found; pass the output directory of a finished training run.")
    config, recorded = config_from_record(json.loads((run / CONFIG_FILE).read_text()))
    return build_saved(run / MODEL_FILE, config, block_factory or recorded, note=note)


def build_saved(path: Path, config: GPTConfig, block_factory, *, note=None) -> GPT:
    """The model of `path` (leaves written by `save_model`) with `block_factory`'s layers."""
    factory = get_block(block_factory)  # first: importing a user's package may register its kernel
    config = usable_kernel(config, note=note)
    skeleton = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0), block_factory=factory)
    try:
        return eqx.tree_deserialise_leaves(path, skeleton)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"{path} does not match the layers of block factory {factory_path(factory)} "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass the factory "
                         "that trained it (block_factory=, or --block MODULE:NAME).") from None
