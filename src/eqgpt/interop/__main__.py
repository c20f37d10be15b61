"""`python -m eqgpt.interop`: training runs to and from Hugging Face directories.

    python -m eqgpt.interop export --run runs/latest --to out/hf             # model.eqx, else the latest checkpoint
    python -m eqgpt.interop export --run runs/latest --to out/hf --step 200  # a particular Orbax checkpoint
    python -m eqgpt.interop import --from out/hf --to runs/gpt2            # a HF directory as a run (model.eqx)

An export holds `config.json`, `model.safetensors` and the run's tokenizer
(`tokenizer.json`, `tokenizer_config.json`); `transformers` loads it with
`GPT2LMHeadModel.from_pretrained` (or `LlamaForCausalLM` for Llama-style runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import equinox as eqx
import jax

from eqgpt.config import GPTConfig
from eqgpt.interop.families import FAMILIES
from eqgpt.nn.factory import DEFAULT_BLOCK, get_block, import_modules
from eqgpt.nn.gpt import GPT


def _run_config(run: Path) -> tuple[GPTConfig, str]:
    """The run's `GPTConfig` and block factory name (model_config.json, else config.json)."""
    from eqgpt.train.export import config_from_record

    if (run / "model_config.json").is_file():
        return config_from_record(json.loads((run / "model_config.json").read_text()))
    if (run / "config.json").is_file():
        data = json.loads((run / "config.json").read_text())
        return config_from_record(data["model"])
    raise ValueError(f"{run} holds neither model_config.json nor config.json; pass a training run's --out-dir.")


def model_from_checkpoint(run: str | Path, step: int | None = None, checkpoint_dir: str | Path | None = None,
                          block_factory=None) -> GPT:
    """The model of a run's Orbax checkpoint (the newest, or `step`), without its optimizer state;
    its layers built by `block_factory` (default: the one the run recorded)."""
    import orbax.checkpoint as ocp

    from eqgpt.train.checkpoint import Checkpointer, named_leaves
    from eqgpt.train.export import usable_kernel

    run = Path(run)
    directory = Path(checkpoint_dir) if checkpoint_dir else run / "checkpoints"
    if not directory.is_dir():
        raise ValueError(f"{directory} does not exist: the run saved no checkpoints (train with --checkpoint-every N).")
    steps = Checkpointer(directory).steps()
    if not steps:
        raise ValueError(f"no committed checkpoint in {directory}.")
    if step is not None and step not in steps:
        raise ValueError(f"no checkpoint {step} in {directory}; committed steps: {steps}.")
    step = steps[-1] if step is None else step
    config, recorded = _run_config(run)
    factory = get_block(block_factory or recorded)
    abstract = eqx.filter_eval_shape(GPT, usable_kernel(config), key=jax.random.key(0), block_factory=factory)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target: dict = {}
    for name, leaf in named_leaves({"model": abstract}).items():
        if isinstance(leaf, jax.ShapeDtypeStruct):
            node = target
            *parents, last = name.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    got = ocp.PyTreeCheckpointer().restore(
        directory / str(step) / "state",
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))

    def pick(name: str):
        node = got
        for p in name.split("."):
            node = node[p]
        return node

    names = named_leaves({"model": abstract})
    leaves = [pick(n) if isinstance(x, jax.ShapeDtypeStruct) else x for n, x in names.items()]
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def export_run(run: str | Path, to: str | Path, *, step: int | None = None, checkpoint_dir: str | Path | None = None,
               family: str | None = None, block_factory=None) -> Path:
    """Write a training run as a Hugging Face directory; **returns** the `model.safetensors` path.

    The model comes from `model.eqx` (the end of training) unless `step` is given or
    there is none, then from the Orbax checkpoint (`step`, else the newest); its layers are
    built by `block_factory` (default: the one the run recorded). Only eqgpt's own block has
    a Hugging Face layout.
    """
    from eqgpt.data.tokenizer import load_tokenizer
    from eqgpt.interop.hf import save_hf
    from eqgpt.train.export import MODEL_FILE, load_model

    run = Path(run)
    if not run.is_dir():
        raise ValueError(f"run directory {run} not found; pass a training run's --out-dir.")
    if step is None and (run / MODEL_FILE).is_file():
        model = load_model(run, block_factory=block_factory)
    else:
        model = model_from_checkpoint(run, step, checkpoint_dir, block_factory=block_factory)
    if model.block_factory_path != DEFAULT_BLOCK:
        raise ValueError(f"{run} was trained with block factory {model.block_factory_path}; a Hugging Face "
                         f"layout holds eqgpt's own block ({DEFAULT_BLOCK}) only.")
    return save_hf(model, to, tokenizer=load_tokenizer(run), family=family)


def import_hf(source: str | Path, to: str | Path) -> Path:
    """A Hugging Face directory as a run directory (`model.eqx`, `model_config.json`, `tokenizer.json`)."""
    from eqgpt.data.tokenizer import TOKENIZER_FILE, load_tokenizer
    from eqgpt.interop.hf import load_hf
    from eqgpt.train.export import save_model

    _, model = load_hf(source)
    path = save_model(to, model)
    src = Path(source) if Path(source).is_dir() else Path(source).parent
    if (src / TOKENIZER_FILE).is_file() or (src / "vocab.json").is_file():
        load_tokenizer(src).save(to)
    return path


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are a `ValueError` (one line, the shared exit status), not usage + exit 2."""

    def error(self, message: str):
        raise ValueError(f"{message} (python -m eqgpt.interop {{export,import}} --help lists the flags)")


def main(argv: list[str] | None = None) -> int:
    """`python -m eqgpt.interop`; **returns** the exit status: 0, or `USER_ERROR_EXIT_CODE` after one line."""
    from eqgpt.cli import USER_ERROR_EXIT_CODE, one_line

    try:
        return _main(argv)
    except (ValueError, OSError) as e:  # a user error (a missing run, an existing --to file): one line
        print(one_line(e, sys.argv[1:] if argv is None else argv), file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE


def _main(argv: list[str] | None) -> int:
    parser = _Parser(prog="python -m eqgpt.interop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ex = sub.add_parser("export", help="a training run -> a Hugging Face directory")
    ex.add_argument("--run", required=True, type=Path, help="the run's --out-dir")
    ex.add_argument("--to", required=True, type=Path, help="output directory")
    ex.add_argument("--step", type=int, default=None, help="export this Orbax checkpoint step")
    ex.add_argument("--checkpoint-dir", type=Path, default=None, help="default: RUN/checkpoints")
    ex.add_argument("--format", choices=("auto", *FAMILIES), default="auto",
                    help="layout (default: the model's)")
    ex.add_argument("--block", default=None, metavar="MODULE:NAME",
                    help="block factory that built the layers (default: the one the run recorded)")
    ex.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="import this module first (it may register kernels and blocks); repeatable")
    im = sub.add_parser("import", help="a Hugging Face directory -> a run directory recipes/sample.py reads")
    im.add_argument("--from", dest="source", required=True, type=Path, help="config.json + model.safetensors")
    im.add_argument("--to", required=True, type=Path, help="output run directory")
    args = parser.parse_args(argv)
    if args.command == "export":
        import_modules(args.imports)
        path = export_run(args.run, args.to, step=args.step, checkpoint_dir=args.checkpoint_dir,
                          family=None if args.format == "auto" else args.format, block_factory=args.block)
    else:
        path = import_hf(args.source, args.to)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
