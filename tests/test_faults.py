"""Faults, each injected: corrupt checkpoints, NaN batches and divergence, killed saves, a full disk.

(Bad token ids are refused by `load_corpus`: tests/test_data.py::test_token_file_vocabulary_from_flag_sidecar_or_ids.
A dead rank under `python -m eqgpt.launch`: tests/test_multiprocess.py::test_dead_rank_stops_the_job.)
"""

import logging
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.train.checkpoint import Checkpointer, CorruptCheckpointError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def biggest_data_file(step_dir: Path) -> Path:
    return max((step_dir / "state").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size)


def corrupt(kind: str, step_dir: Path) -> Path:
    """Damage checkpoint `step_dir` the way `kind` says; **returns** the damaged file."""
    if kind == "truncated":
        f = biggest_data_file(step_dir)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "flipped bytes":
        f = biggest_data_file(step_dir)
        data = bytearray(f.read_bytes())
        for i in range(len(data) // 3, len(data) // 3 + 4):
            data[i] ^= 0x5A
        f.write_bytes(bytes(data))
    else:  # "metadata deleted"
        f = step_dir / "state" / "_METADATA"
        f.unlink()
    return f


@pytest.mark.parametrize("kind", ["truncated", "flipped bytes", "metadata deleted"])
def test_corrupt_checkpoint_is_named_and_skipped_or_refused(tmp_path, kind, caplog):
    state = {"w": jnp.arange(4096.0).reshape(64, 64), "b": jnp.ones(3)}
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(10, state)
        ck.save(20, {k: v * 2 for k, v in state.items()})
    damaged = corrupt(kind, tmp_path / "20")
    before = files_under(tmp_path)

    # --strict: refused, naming the step and the file; nothing changes on disk.
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint 20 in .* is corrupt \(.*{damaged.name}.*\)\. Strict"):
        Checkpointer(tmp_path).restore(state, strict=True)
    assert files_under(tmp_path) == before

    # Default: a warning naming the step and the file, then the newest intact checkpoint.
    with caplog.at_level(logging.WARNING, logger="eqgpt.train.checkpoint"):
        got = Checkpointer(tmp_path).restore(state)
    assert got.step == 10 and got.skipped[0][0] == 20
    np.testing.assert_array_equal(got.state["w"], np.asarray(state["w"]))
    warning = next(r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage())
    assert "checkpoint 20" in warning and str(damaged) in warning and "falling back to 10" in warning, warning
    # Nothing deleted: the damaged checkpoint is set aside whole, as `20.corrupt`.
    after = files_under(tmp_path)
    assert {k.replace("20.corrupt/", "20/", 1): v for k, v in after.items()} == before
