"""Run directories: each training run writes to a fresh `ROOT/NAME-YYYYmmdd-HHMMSS`, and
`ROOT/latest` points at the newest, so a second run never overwrites the first and the
sampler can say which run it loads."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

LATEST = "latest"


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


def point_latest(run: str | Path) -> None:
    """Point `latest` beside `run` at it (process 0 only; relative, so the runs directory can move)."""
    if jax.process_index() != 0:
        return
    link = Path(run).parent / LATEST
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(run).name, target_is_directory=True)


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
