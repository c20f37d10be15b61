"""Run directories: each training run writes to a fresh `ROOT/NAME-YYYYmmdd-HHMMSS`, and
`ROOT/latest` points at the newest, so a second run never overwrites the first and the
sampler can say which run it loads.

The policy: a new run never writes into a directory holding another run's files
(`run_to_continue` refuses it); `--resume` continues the named run (default: the one
`ROOT/latest` points at); a finished run asked for no more steps is left as it is
(`finished`); and a directory is created only once every check has passed (the caller
calls `new_run_dir` last).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np

LATEST = "latest"
ROOT = "runs"  # where runs go by default
RUN_FILES = ("config.json", "metrics.jsonl", "model.eqx", "summary.json", "checkpoints")  # a run's own files


def run_to_continue(out_dir: str | Path | None, checkpoint_dir: str | Path | None, *, resume: bool,
                    root: str | Path = ROOT) -> Path | None:
    """With `resume`, the run directory to continue (`out_dir`, else the one `root/latest` points at);
    else `None`, after refusing an `out_dir` or `checkpoint_dir` that holds another run's files.
    **Raises** `ValueError` naming --out-dir or --checkpoint-dir and the fix. Writes nothing."""
    if resume:
        try:
            out = Path(out_dir) if out_dir is not None else latest_run_dir(root)
        except FileNotFoundError as e:
            raise ValueError(f"--resume: {e} Pass --out-dir to name the run to continue.") from None
        ckpt = Path(checkpoint_dir or out / "checkpoints")
        if (out / "model.eqx").is_file() and not (ckpt.is_dir() and any(ckpt.iterdir())):
            raise ValueError(f"--resume: {out} holds a finished run without checkpoints; it cannot be continued, "
                             "and starting it again would overwrite it: choose a new --out-dir.")
        return out
    if out_dir is not None and any((Path(out_dir) / f).exists() for f in RUN_FILES):
        raise ValueError(f"--out-dir {out_dir} holds another run; add --resume to continue it, or choose "
                         "a new directory (a run never overwrites another's outputs).")
    if checkpoint_dir is not None and Path(checkpoint_dir).is_dir() and any(Path(checkpoint_dir).iterdir()):
        raise ValueError(f"--checkpoint-dir {checkpoint_dir} holds another run's checkpoints; add --resume to "
                         "continue from them, or choose an empty directory.")
    return None


def new_run_dir(out_dir: str | Path | None, name: str, *, root: str | Path = ROOT) -> Path:
    """`out_dir` (created), else a fresh `root/name-<time>` (`fresh_run_dir`); `root/latest` is left for
    `point_latest` once the run trains. Call it after every check: it is the run's first write."""
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return Path(out_dir)
    return fresh_run_dir(root, name, latest=False)


def finished(out: Path, checkpoint_dir: str | Path | None, steps: int) -> dict | None:
    """The summary of a run in `out` that has finished `steps` (its newest checkpoint at or past them,
    its outputs written), marked `finished`; `None` when there is training left to do."""
    from eqgpt.train.checkpoint import Checkpointer

    ckpt = Path(checkpoint_dir or out / "checkpoints")
    summary = out / "summary.json"
    if not (ckpt.is_dir() and summary.is_file()):
        return None
    done = json.loads(summary.read_text())
    step = Checkpointer(ckpt).latest_step()
    if step is None or step < steps or done.get("interrupted") or "stopped" in done:
        return None
    return {**done, "finished": True, "interrupted": False}


def earlier_rows(out: Path, step: int) -> list[dict]:
    """The metrics.jsonl rows before a resume at `step` (its validation at `step` is measured again);
    the file is cut to them (by process 0), so that each step is logged once across resumes."""
    path = out / "metrics.jsonl"
    if jax.process_index() != 0 or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] < step or (r["step"] == step and "val_loss" not in r)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def fresh_run_dir(root: str | Path, name: str, *, latest: bool = True) -> Path:
    """Create `root/name-<local time>` (with `-2`, `-3`, ... if that exists) and, with
    `latest`, point `root/latest` at it. Every process of a multi-process run gets the same
    directory: process 0 chooses it.

    **Arguments:** `root` (the runs directory), `name` (the run's prefix, e.g. the preset),
    `latest` (`False`: leave `root/latest` alone; `point_latest` later, once the run trains).

    **Returns:** the new directory.
    """
    root = Path(root)
    stamp, suffix = int(time.time()), 1
    if jax.process_index() == 0:
        while _named(root, name, stamp, suffix).exists():
            suffix += 1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        stamp, suffix = (int(x) for x in multihost_utils.broadcast_one_to_all(np.array([stamp, suffix], np.int64)))
    out = _named(root, name, stamp, suffix)
    if jax.process_index() == 0:
        out.mkdir(parents=True)
        if latest:
            point_latest(out)
    return out


def under_root(run: str | Path, root: str | Path = ROOT) -> bool:
    """Whether `run` lies directly in `root` (however it was named): then `root/latest` follows it."""
    return Path(run).absolute().parent.resolve() == Path(root).absolute().resolve()


def point_latest(run: str | Path) -> str | None:
    """Point `latest` beside `run` at it (process 0 only; relative, so the runs directory can move);
    **returns** what it pointed at before (`None`: nothing), for `leave_run` to put back."""
    if jax.process_index() != 0:
        return None
    link = Path(run).parent / LATEST
    before = os.readlink(link) if link.is_symlink() else None
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(run).name, target_is_directory=True)
    return before


def committed_steps(checkpoint_dir: str | Path) -> list[int]:
    """The committed checkpoint steps in `checkpoint_dir` (numbered directories; interrupted writes and
    set-aside steps carry suffixes), read from the listing alone: safe while another thread trains."""
    path = Path(checkpoint_dir)
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit()) if path.is_dir() else []


def leave_run(out: Path, checkpoint_dir: str | Path, *, new: bool, latest_before: str | None = None) -> str:
    """What a stopped run leaves: its newest checkpoint, named; or, for a `new` run that reached none,
    nothing (the directory is removed and `latest` put back). **Returns** the sentence that says so."""
    steps = committed_steps(checkpoint_dir)
    if steps:
        return f"The newest checkpoint is step {steps[-1]} in {checkpoint_dir}: --resume continues from it."
    if not new or jax.process_index() != 0:
        return "No checkpoint was reached."
    shutil.rmtree(out, ignore_errors=True)
    link = Path(out).parent / LATEST
    if link.is_symlink() and os.readlink(link) == Path(out).name:
        link.unlink()
        if latest_before is not None:
            link.symlink_to(latest_before, target_is_directory=True)
    return f"No step was completed, so no checkpoint: the new run directory {out} was removed."


def latest_run_dir(root: str | Path) -> Path:
    """The directory `root/latest` points at. **Raises** `FileNotFoundError` naming `root`
    when there is no run there yet."""
    link = Path(root) / LATEST
    if not link.exists():
        raise FileNotFoundError(f"no run in {root}/ yet ({link} does not exist); train one, or name its directory.")
    return link.resolve()


def _named(root: Path, name: str, stamp: int, suffix: int) -> Path:
    base = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(stamp))}"
    return root / (base if suffix == 1 else f"{base}-{suffix}")


__all__ = ["LATEST", "ROOT", "RUN_FILES", "committed_steps", "earlier_rows", "finished", "fresh_run_dir",
           "latest_run_dir", "leave_run", "new_run_dir", "point_latest", "run_to_continue", "under_root"]
