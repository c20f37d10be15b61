"""Files that appear whole or not at all, for readers that may look at any moment."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def written_whole(path: str | os.PathLike, mode: str = "wb"):
    """A file opened for writing that appears at `path` whole or not at all. It is written to a
    temporary file beside `path`, flushed to disk and renamed over it on success (`os.replace` is
    atomic), and removed on failure. Neither a crash nor another process reading meanwhile (every rank
    of a job loads the same corpus cache) sees half of it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["written_whole"]
