"""Flags checked before anything is compiled or written, each error naming the flag typed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from eqgpt import distributed
from eqgpt.train.guards import Guard
from eqgpt.train.logging import check_tensorboard

if TYPE_CHECKING:
    from eqgpt.cli.train import TrainConfig

# (flag, dataclass path, test, what it must be). NaN fails every test.
_POSITIVE = (lambda v: v > 0, "above 0")
_AT_LEAST_0 = (lambda v: v >= 0, "at least 0")
_AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
_FRACTION = (lambda v: 0 <= v <= 1, "between 0 and 1")
_DECAY = (lambda v: 0 <= v < 1, "in [0, 1)")
_PERCENT = (lambda v: 0 < v < 100, "in (0, 100): above 0 and below 100")  # as load_corpus says

NUMERIC_FLAGS = {
    "optim.lr": _POSITIVE, "optim.warmup_steps": _AT_LEAST_0, "optim.min_lr_ratio": _FRACTION,
    "optim.weight_decay": _AT_LEAST_0, "optim.b1": _DECAY, "optim.b2": _DECAY, "optim.clip_norm": _AT_LEAST_0,
    "data.val_percent": _PERCENT, "data.threads": _AT_LEAST_0, "data.prefetch": _AT_LEAST_1,
    "model.seq_len": _AT_LEAST_1, "model.num_layers": _AT_LEAST_1, "model.num_heads": _AT_LEAST_1,
    "model.num_kv_heads": _AT_LEAST_1, "model.embed_dim": _AT_LEAST_1, "model.mlp_dim": _AT_LEAST_1,
    "model.window": _AT_LEAST_1, "model.vocab_size": _AT_LEAST_1, "model.num_experts": _AT_LEAST_1,
    "model.top_k": _AT_LEAST_1, "model.capacity_factor": _POSITIVE,
    "z_loss": _AT_LEAST_0, "peak_flops": _POSITIVE, "seed": _AT_LEAST_0, "cpu_devices": _AT_LEAST_1,
}


def flag_name(path: str) -> str:
    """The flag a user types for a config field path: `optim.warmup_steps` -> `--optim.warmup-steps`."""
    return "--" + path.replace("_", "-")


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def check_numbers(cfg, flags: dict = NUMERIC_FLAGS) -> None:
    """Raise `ValueError` naming the first numeric flag out of its range (unset flags pass)."""
    for path, (ok, want) in flags.items():
        value = _get(cfg, path)
        if value is None or isinstance(value, str):
            continue
        if isinstance(value, float) and not math.isfinite(value) or not ok(value):
            raise ValueError(f"{flag_name(path)} must be {want}, got {value}.")
    profile = getattr(cfg, "profile_steps", None)
    if profile is not None and not 0 <= profile[0] < profile[1]:
        raise ValueError(f"--profile-steps {profile[0]} {profile[1]}: give START STOP with 0 <= START < STOP "
                         "(e.g. 10 15 traces steps 10 to 14).")
    batch, accum = getattr(cfg, "batch_size", None), getattr(cfg, "accum_steps", 1)
    if isinstance(batch, int) and accum >= 1 and batch % accum:
        raise ValueError(f"--batch-size {batch} must be divisible by --accum-steps {accum} (microbatches per step).")


def check_writable(path, flag: str) -> None:
    """Raise `ValueError` naming `flag` when `path` (or, if it does not exist yet, its nearest
    existing parent) cannot be written."""
    import os
    import tempfile

    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise ValueError(f"{flag} {path}: {p} is a file, not a directory.")
    try:  # a real write: permissions, read-only file systems, root included
        os.rmdir(tempfile.mkdtemp(prefix=".eqgpt-check-", dir=p))
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {p} ({e.strerror or e}); choose a directory "
                         "you can write to.") from None


def check_fault_flags(cfg: TrainConfig) -> None:
    """Refuse fault flags that cannot apply (before anything is written or compiled)."""
    Guard(cfg.max_skipped, cfg.divergence_factor, cfg.divergence_window)  # names the bad flag
    for flag in ("strict", "allow_fresh", "allow_new_corpus"):
        if getattr(cfg, flag) and not cfg.resume:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --resume only; add --resume or drop it.")


def check_run_flags(cfg: TrainConfig) -> None:
    """Refuse counts, directories and optional packages the run cannot use, naming the flag, before
    JAX starts and anything is written or compiled."""
    at_least = {"steps": 1, "accum_steps": 1, "log_every": 1, "checkpoint_keep": 1, "checkpoint_every": 0,
                "eval_every": 0, "eval_windows": 0, "sample_tokens": 0}
    if cfg.batch_size != "auto":
        at_least["batch_size"] = 1
    for name, low in at_least.items():
        if getattr(cfg, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(cfg, name)}.")
    check_numbers(cfg)
    if cfg.compile_only or cfg.slice:  # the console script hands these to eqgpt.cli.plan (eqgpt.cli.entry)
        raise ValueError("--compile-only and --slice belong to the eqgpt-train console script (or eqgpt-plan); "
                         "run `eqgpt-train --compile-only --slice v5e-16 ...`.")
    for name in ("out_dir", "checkpoint_dir"):
        path = getattr(cfg, name)
        if path is not None and str(path) in ("", "."):  # '' parses as '.': an unset shell variable, most likely
            raise ValueError(f"--{name.replace('_', '-')} is empty (or '.'): it would write the run into the current "
                             "directory; name a directory (an unset shell variable?), or leave the flag out.")
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"--{name.replace('_', '-')} {path} is a file; name a directory.")
    check_writable(cfg.out_dir or "runs", "--out-dir")
    if cfg.checkpoint_dir is not None:
        check_writable(cfg.checkpoint_dir, "--checkpoint-dir")
    processes = distributed.resolve_settings().num_processes  # from the environment: no backend started yet
    if cfg.batch_size != "auto" and cfg.batch_size % processes:
        raise ValueError(f"--batch-size {cfg.batch_size} does not split over {processes} processes (each "
                         f"loads its share of the rows): use a multiple of {processes}.")
    if cfg.log == "tensorboard":
        check_tensorboard()
    check_fault_flags(cfg)
