"""File checksums of a checkpoint: `files.json`, written just before the commit, checked on restore.

Orbax's atomic rename guarantees that a step directory is complete when it
appears; it cannot tell when a file in it is later truncated, altered or
removed (a failing disk, a partial copy between file systems, a careless
cleanup). `SealedRename` lists every file of the checkpoint with its size and
CRC-32 in `<step>/files.json` after all processes have finished writing and
before the directory is renamed into place, so every committed checkpoint
carries its own seal. `verify_files` re-reads the files and names the first
one that differs.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from eqgpt.files import written_whole

MANIFEST = "files.json"
_FORMAT = "eqgpt-files/1"
# Written by Orbax during the commit itself (after the seal), and the seal: not listed.
_UNSEALED = frozenset({MANIFEST, "_CHECKPOINT_METADATA", "commit_success.txt"})
_CHUNK = 1 << 22


class DamagedFileError(OSError):
    """A checkpoint file is missing, or differs from its size or CRC-32 in `files.json`."""


def crc32(path: Path) -> int:
    """CRC-32 of a file's bytes, read in 4 MiB chunks."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _listed(directory: Path) -> list[str]:
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in _UNSEALED:
                names.append(rel)
    return sorted(names)


def write_manifest(directory: str | os.PathLike) -> dict:
    """List every file under `directory` with its size and CRC-32 in `directory/files.json`.

    **Arguments:** `directory`, a checkpoint's (temporary) step directory.

    **Returns:** the manifest written.
    """
    directory = Path(directory)
    files = {rel: [os.path.getsize(directory / rel), crc32(directory / rel)] for rel in _listed(directory)}
    manifest = {"format": _FORMAT, "files": files}
    with written_whole(directory / MANIFEST, "w") as f:
        json.dump(manifest, f)
    return manifest


_MISSING, _SIZE, _BYTES = 1, 2, 3


def _damage(path: Path, size: int, crc: int) -> int:
    if not path.exists():
        return _MISSING
    if os.path.getsize(path) != size:
        return _SIZE
    return _BYTES if crc32(path) != crc else 0


def _message(path: Path, kind: int, size: int) -> str:
    if kind == _MISSING:
        return f"file {path} is missing"
    if kind == _SIZE:
        actual = os.path.getsize(path) if path.exists() else 0
        return f"file {path} has {actual} bytes, {size} when saved (truncated or overwritten)"
    return f"file {path} has other bytes than when saved (CRC-32 differs)"


def verify_files(directory: str | os.PathLike, share: tuple[int, int] | None = None) -> bool:
    """Check the files of a step directory against its `files.json`.

    With several processes (and no `share`), each reads every `process_count`-th file
    and they agree on the result: all raise the same error, or none does.

    **Arguments:** `directory`; `share`: `(index, count)` to check every `count`-th
    file from `index` alone (default: this process's share, agreed with the others).

    **Returns:** `True` when checked, `False` when there is no `files.json` (an
    older checkpoint). **Raises** `DamagedFileError` naming the first bad file.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        return False
    try:
        files = json.loads(path.read_text())["files"]
        names = sorted(files)
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFileError(f"file {path} cannot be read ({type(e).__name__})") from None
    agree = share is None and jax.process_count() > 1
    index, count = share if share is not None else (jax.process_index(), jax.process_count())
    first, kind = len(names), 0
    for i in range(index, len(names), count):
        size, crc = files[names[i]]
        if found := _damage(directory / names[i], size, crc):
            first, kind = i, found
            break
    if agree:  # the lowest damaged index over all processes, so that all report the same file
        from jax.experimental import multihost_utils

        found = np.asarray(multihost_utils.process_allgather(np.array([first, kind], np.int64)))
        first, kind = (int(x) for x in found[np.argmin(found[:, 0])])
    if first < len(names):
        raise DamagedFileError(_message(directory / names[first], kind, files[names[first]][0]))
    return True


class SealedRename(ocp.path.atomicity.AtomicRenameTemporaryPath):
    """Orbax's atomic rename, preceded by `write_manifest` of the finished temporary directory.

    Orbax calls `finalize` on the primary process once every process has written
    its files, so the manifest lists all of them; a write killed before the seal
    leaves only a temporary directory, which is never listed as a step.
    """

    async def finalize(self, *args, **kwargs):
        if self.get_final().name.isdigit():  # the step directory (items finalize through this class too)
            write_manifest(self.get())
        return await super().finalize(*args, **kwargs)


__all__ = ["MANIFEST", "DamagedFileError", "SealedRename", "crc32", "verify_files", "write_manifest"]
