"""Checkpoints on Orbax: sharded, asynchronous, atomic, validated, and restorable onto any mesh.

A checkpoint of step `s` is the directory `<dir>/<s>/` with three Orbax items:

- `state/`: every array of the training state (model, optimizer state, step,
  RNG, ...) under its tree path, e.g. `model.blocks.attn.q_proj.weight`. Each
  process writes only the shards it holds (Orbax's OCDBT format, one
  `ocdbt.process_<i>/` per process).
- `config/metadata`: the run's configuration as readable JSON.
- `meta/metadata`: JSON with the step, the data position (`extras`) and a
  checksum of every array.
- `files.json`: the size and CRC-32 of every file above, written last, just
  before the commit (`eqgpt.train.integrity`).

Writes go to a temporary directory that Orbax renames into place only after
every process has finished (its atomic-rename commit protocol), so an
interrupted write never appears as a step. Restoring re-checks what the rename
cannot: every file must match `files.json` (a damaged file is named), the
configuration must match the running one, every array must exist with the
expected shape and dtype, and every array's checksum must match. A damaged
checkpoint is skipped with a warning naming the step, the file and the
fallback (or, with `strict=True`, refused); an incompatible one stops the run
with a message naming the field.

Restoring takes its shardings from the *restoring* run: the target is this
run's state (concrete, or abstract `jax.ShapeDtypeStruct`s with `sharding=`),
so a run saved on `fsdp=8` continues on `data=4,tensor=2` or on one device.

This module is the policy (when to save, how many to keep, which checkpoint to trust and what
to do with a damaged one); `eqgpt.train.checkpoint_io` holds the I/O it calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from eqgpt.distributed import is_main_process
from eqgpt.train.checkpoint_io import (
    abstract_state,
    all_ok,
    barrier,
    checksums,
    is_array,
    is_key,
    named_leaves,
    nest,
    restore_args,
    restore_target,
    state_handler,
    unnest,
)
from eqgpt.train.integrity import MANIFEST, SealedRename, verify_files

logger = logging.getLogger(__name__)

FORMAT = "eqgpt-checkpoint/2"  # /2: sealed with files.json
_FORMATS = ("eqgpt-checkpoint/1", FORMAT)  # /1 (no files.json) still restores, checked by array checksums


class CheckpointError(ValueError):
    """A checkpoint could not be used; the message says why and what to do."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint belongs to a different model or state layout than this run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, lost permissions, a failing file system).

    The write is never committed; the checkpoints before it stay intact and restorable.
    """


class CorruptCheckpointError(CheckpointError):
    """The checkpoint (and every earlier one) is damaged: missing files, bad data, bad checksums."""


# --- config comparison ---------------------------------------------------------------------------


def _to_json(value: Any) -> Any:
    """Dataclasses, mappings, tuples and scalars as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        out = []
        for k in sorted(set(saved) | set(current)):
            name = f"{prefix}{k}"
            if k not in saved:
                out.append(f"{name}: absent in the checkpoint, {current[k]!r} in this run")
            elif k not in current:
                out.append(f"{name}: {saved[k]!r} in the checkpoint, absent in this run")
            else:
                out.extend(_differences(saved[k], current[k], name + "."))
        return out
    return ([] if saved == current
            else [f"{prefix[:-1] or 'config'}: {saved!r} in the checkpoint, {current!r} in this run"])


# --- the manager ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` found.

    **Fields:** `state` (the target's structure, with restored arrays in the
    target's shardings), `step`, `extras` (as saved, e.g. the data position),
    `config` (as saved), and `skipped`: `(step, reason)` for every newer
    checkpoint that was damaged and passed over.
    """

    state: PyTree
    step: int
    extras: dict
    config: dict
    skipped: tuple[tuple[int, str], ...] = ()


class Checkpointer:
    """Saves and restores training states in `directory` (see the module docs for the layout).

    **Arguments:**

    - `directory`: where the step directories go (created if missing).
    - `every`: `should_save(step)` is true every `every` steps.
    - `keep`: how many of the newest checkpoints to keep (older ones are deleted).
    - `async_save`: write in background threads while training continues
      (device-to-host copies happen before `save` returns); `wait()` joins them.
    - `config`: the run's configuration (dataclasses / mappings), saved as JSON.
    - `must_match`: top-level keys of `config` that a checkpoint must share with
      this run to be restored (default `("model",)`); others may change.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int = 100,
        keep: int = 3,
        async_save: bool = True,
        config: Mapping[str, Any] | Any | None = None,
        must_match: Sequence[str] = ("model",),
    ):
        if every < 1:
            raise ValueError(f"checkpoint interval must be at least 1 step, got every={every}.")
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint), got keep={keep}.")
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} exists and is not a directory.")
        self.every = every
        self.keep = keep
        self.config = _to_json(config if config is not None else {})
        if not isinstance(self.config, dict):
            raise ValueError(f"config must be a mapping or dataclass, got {type(config).__name__}.")
        self.must_match = tuple(must_match)
        # Leftovers of interrupted writes stay until this run's first save removes them: a run whose
        # every write was interrupted has no checkpoint but did start (the recipe refuses to start
        # afresh unasked, and says so again on every attempt until asked).
        self.interrupted_writes = sorted(
            p.name for p in self.directory.glob("*.orbax-checkpoint-tmp*")) if self.directory.is_dir() else []
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=policies.LatestN(keep),
            save_decision_policy=policies.FixedIntervalPolicy(every),
            cleanup_tmp_directories=False,  # leftovers of interrupted writes: removed by the first save
            create=True,
            temporary_path_class=SealedRename,  # writes files.json just before the commit
        )
        handlers = {"state": state_handler(), "config": ocp.JsonCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._pending: int | None = None  # the step being written in the background

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, every={self.every}, keep={self.keep})"

    # Steps ---------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (interrupted writes are never listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or `None`."""
        steps = self.steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether `step` is on the save interval (`step % every == 0`, step > 0)."""
        return step > 0 and step % self.every == 0

    # Save ----------------------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, *, extras: Mapping[str, Any] | None = None) -> bool:
        """Write `state` as checkpoint `step` (every process must call this with its shards).

        Returns once the arrays are copied to host memory; the files are written
        in the background when `async_save`. An existing `step` is left as is.

        **Arguments:** `step`, `state` (a pytree: model, optimizer state, ...),
        `extras` (JSON-able, e.g. `{"data": {"seed": 0, "step": step}}`).

        **Returns:** whether a checkpoint was started.
        """
        step = int(step)
        self.wait()  # the previous write's failure, if any, is reported (and named) here
        if self.interrupted_writes:
            self._remove_leftovers()
        if step in self._manager.all_steps():
            logger.info("checkpoint %d already exists in %s; not rewritten", step, self.directory)
            return False
        leaves = named_leaves(state)
        arrays, keys, scalars = {}, {}, {}
        for name, leaf in leaves.items():
            if is_key(leaf):
                keys[name] = str(jax.random.key_impl(leaf))
                arrays[name] = jax.random.key_data(leaf)
            elif isinstance(leaf, jax.Array):
                arrays[name] = leaf
            elif isinstance(leaf, (bool, int, float, str, np.integer, np.floating)):
                scalars[name] = _to_json(leaf)
        meta = {
            "format": FORMAT,
            "step": step,
            "extras": _to_json(dict(extras or {})),
            "checksums": checksums(arrays),
            "keys": keys,
            "scalars": scalars,
            "process_count": jax.process_count(),
        }
        self._pending = step
        started = self._reporting_failure(self._manager.save, step, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(nest(arrays)),
            config=ocp.args.JsonSave(self.config),
            meta=ocp.args.JsonSave(meta),
        ), force=True)
        return bool(started)

    def _reporting_failure(self, fn, *args, **kwargs):
        """`fn(...)`, turning any failure of the write in flight into a `CheckpointWriteError`."""
        try:
            return fn(*args, **kwargs)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the file system says, name the step
            step, self._pending = self._pending, None
            intact = [s for s in self.steps() if s != step]
            kept = (f"checkpoint {intact[-1]} (the newest before it) is intact and restorable"
                    if intact else "no earlier checkpoint exists")
            raise CheckpointWriteError(
                f"could not write checkpoint {step} to {self.directory} ({_os_reason(e) or _describe(e)}); "
                "it was not committed, "
                f"and {kept}. Free space on that file system (or choose another checkpoint directory), "
                "then rerun with --resume."
            ) from e

    def _remove_leftovers(self) -> None:
        if is_main_process():
            for name in self.interrupted_writes:
                shutil.rmtree(self.directory / name, ignore_errors=True)
        self.interrupted_writes = []
        barrier("eqgpt-checkpoint-leftovers")

    def maybe_save(self, step: int, state: PyTree, *, extras: Mapping[str, Any] | None = None,
                   force: bool = False) -> bool:
        """`save` if `should_save(step)` or `force` (e.g. on preemption). **Returns:** whether it saved."""
        if force or self.should_save(step):
            return self.save(step, state, extras=extras)
        return False

    def wait(self) -> None:
        """Block until every background write is committed (call before exiting).

        **Raises** `CheckpointWriteError` naming the step when a write failed (e.g. the disk is full).
        """
        self._reporting_failure(self._manager.wait_until_finished)
        self._pending = None

    def close(self) -> None:
        """`wait`, then release Orbax's threads."""
        try:
            self.wait()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Restore -------------------------------------------------------------------------------------

    def _read_json(self, step: int) -> tuple[dict, dict]:
        got = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        )
        config, meta = got["config"], got["meta"]
        if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
            raise CorruptCheckpointError(f"its meta item is not an {FORMAT} record")
        if int(meta.get("step", -1)) != step:
            raise CorruptCheckpointError(f"its meta item says step {meta.get('step')}")
        return config, meta

    def _check_config(self, step: int, saved: dict) -> None:
        problems = []
        for key in self.must_match:
            if key in self.config:  # a run that states no such section checks only the arrays
                problems.extend(_differences(saved.get(key), self.config.get(key), f"{key}."))
        if problems:
            raise IncompatibleCheckpointError(
                f"checkpoint {step} in {self.directory} was written for a different configuration: "
                + "; ".join(problems)
                + ". Restore with the configuration it was saved with, or start this run in a new directory."
            )

    def _check_layout(self, step: int, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
        """Raises `IncompatibleCheckpointError` unless the saved arrays fit `targets`; **returns** their metadata."""
        metadata = self._manager.item_metadata(step)["state"]
        tree = getattr(metadata, "tree", metadata)
        if not isinstance(tree, Mapping):
            raise CorruptCheckpointError("its array metadata cannot be read")
        saved = unnest(tree)
        missing = sorted(set(targets) - set(saved))
        extra = sorted(set(saved) - set(targets))
        wrong = [
            f"{n}: {tuple(saved[n].shape)} {saved[n].dtype} in the checkpoint, "
            f"{tuple(t.shape)} {t.dtype} in this run"
            for n, t in targets.items()
            if n in saved and (tuple(saved[n].shape) != tuple(t.shape) or np.dtype(saved[n].dtype) != np.dtype(t.dtype))
        ]
        if missing or extra or wrong:
            parts = []
            if wrong:
                parts.append("arrays differ: " + "; ".join(wrong[:6]) + (" ..." if len(wrong) > 6 else ""))
            if missing:
                parts.append("this run has arrays the checkpoint lacks: " + ", ".join(missing[:6])
                             + (" ..." if len(missing) > 6 else ""))
            if extra:
                parts.append("the checkpoint has arrays this run lacks: " + ", ".join(extra[:6])
                             + (" ..." if len(extra) > 6 else ""))
            raise IncompatibleCheckpointError(
                f"checkpoint {step} in {self.directory} does not fit this run's state ({'; '.join(parts)}). "
                "The model or optimizer differs from the one that wrote it; use the same ones or a new directory."
            )
        return saved

    def saved_record(self, step: int) -> tuple[dict, dict]:
        """The configuration and the extras (data position, ...) saved with checkpoint `step`, read
        without its arrays: what a resume checks before it restores. **Raises** on a damaged record."""
        config, meta = self._read_json(step)
        return dict(config), dict(meta.get("extras", {}))

    def _restore_one(self, step: int, target: PyTree, check=None) -> Restored:
        leaves = named_leaves(target)
        targets = {n: restore_target(x) for n, x in leaves.items() if is_array(x)}
        sealed = verify_files(self.directory / str(step))  # names a missing, truncated or altered file;
        # every process reads its share of the files and all agree on the verdict
        config, meta = self._read_json(step)
        if meta.get("format") == FORMAT and not sealed:
            raise CorruptCheckpointError(f"{MANIFEST} is missing (every {FORMAT} checkpoint has one)")
        if check is not None:
            check(step, dict(config), dict(meta.get("extras", {})))
        self._check_config(step, config)
        saved = self._check_layout(step, targets)
        got = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=nest(targets), restore_args=restore_args(targets, saved))))
        arrays = unnest(got["state"])
        saved_sums = {k: int(v) for k, v in meta.get("checksums", {}).items()}
        bad = [n for n, s in checksums(arrays).items() if saved_sums.get(n) != s]
        if bad:
            raise CorruptCheckpointError(
                f"checksums do not match for {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} (damaged data)"
            )
        restored = []
        for name, leaf in leaves.items():
            if name in arrays:
                value = arrays[name]
                if isinstance(leaf, jax.Array) and not leaf.committed:
                    # An uncommitted target (a fresh `jnp.asarray(0)`, `jax.random.key(0)`) may
                    # join any computation; keep it so rather than pinning it to one device.
                    value = jax.device_put(np.asarray(value))
                if name in meta.get("keys", {}) or is_key(leaf):
                    impl = meta.get("keys", {}).get(name) or str(jax.random.key_impl(leaf))
                    value = jax.random.wrap_key_data(value, impl=impl)
                restored.append(value)
            elif name in meta.get("scalars", {}):
                restored.append(type(leaf)(meta["scalars"][name]) if leaf is not None else meta["scalars"][name])
            else:
                restored.append(leaf)
        state = jax.tree.unflatten(jax.tree.structure(target), restored)
        return Restored(state, step, dict(meta.get("extras", {})), dict(config))

    def traces(self) -> list[str]:
        """Signs of earlier checkpoints that are not usable ones: leftovers of interrupted writes and
        steps set aside as damaged (`<step>.corrupt`); empty for a directory never written to."""
        corrupt = sorted(p.name for p in self.directory.glob("*.corrupt*")) if self.directory.is_dir() else []
        return [*self.interrupted_writes, *corrupt]

    def restore(self, target: PyTree, step: int | None = None, *, strict: bool = False,
                allow_fresh: bool = False, check=None) -> Restored | None:
        """Restore a checkpoint into the structure and shardings of `target`.

        With `step=None` the newest committed checkpoint is tried first; a damaged
        one (a file that differs from `files.json`, unreadable metadata, a checksum
        mismatch) is logged as `"checkpoint 30 in DIR is corrupt (file DIR/30/state/d/...
        has 100 bytes, 267 when saved ...); falling back to 20"`, the next older one is
        tried, and the damaged ones are renamed `30.corrupt` (never deleted). A checkpoint
        of a different model (config fields in `must_match`, array names, shapes or
        dtypes) raises `IncompatibleCheckpointError` at once: no fallback can fix that.

        **Arguments:**

        - `target`: this run's state (concrete arrays, or `jax.ShapeDtypeStruct`s
          with `sharding=`): its shardings decide where the restored shards go.
        - `step`: a particular step (no fallback), or `None` for the latest good one.
        - `strict`: refuse (raise `CorruptCheckpointError`) when the newest checkpoint is
          damaged, instead of falling back; nothing is renamed.
        - `allow_fresh`: return `None` even when the directory holds no complete checkpoint but
          `traces()` of earlier ones (a run killed in its first save); by default that raises
          `CheckpointError`, so that a resume never starts over unasked.
        - `check`: `check(step, config, extras)`, called with each candidate's saved record before its
          arrays are read; an `IncompatibleCheckpointError` it raises refuses the restore at once,
          before any damaged checkpoint is set aside (nothing on disk changes).

        **Returns:** a `Restored`, or `None` when the directory holds no checkpoint.
        Raises `CorruptCheckpointError` when every candidate is damaged (or, with
        `strict`, the first one).
        """
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no committed checkpoint {step} in {self.directory}; committed steps: {steps or 'none'}."
                )
            candidates = [step]
        else:
            candidates = steps[::-1]
        if not candidates:
            traces = self.traces()
            if traces and not allow_fresh:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory}, only traces of earlier ones ({', '.join(traces)}): "
                    "the run that wrote them was stopped before any checkpoint was complete. To start at step 0, "
                    "allow it (recipe: --allow-fresh; API: restore(..., allow_fresh=True))."
                )
            return None
        skipped: list[tuple[int, str]] = []
        for i, s in enumerate(candidates):
            error: Exception | None = None
            try:
                result = self._restore_one(s, target, check)
            except IncompatibleCheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read is damage
                error, result = e, None
            if all_ok(error is None):
                if skipped:
                    self.set_aside([t for t, _ in skipped])
                return dataclasses.replace(result, skipped=tuple(skipped))
            reason = _describe(error) if error is not None else "another process could not read it"
            skipped.append((s, reason))
            following = candidates[i + 1] if i + 1 < len(candidates) else None
            if strict:
                raise CorruptCheckpointError(
                    f"checkpoint {s} in {self.directory} is corrupt ({reason}). Strict: not falling back"
                    + (f" to {following}" if following is not None else "")
                    + "; nothing was changed. Resume without strict to continue from the newest intact "
                    "checkpoint, or repair the file."
                )
            if step is None:
                logger.warning(
                    "checkpoint %d in %s is corrupt (%s); %s", s, self.directory, reason,
                    f"falling back to {following}" if following is not None else "no older checkpoint left",
                )
        listing = "; ".join(f"checkpoint {t}: {r}" for t, r in skipped)
        raise CorruptCheckpointError(
            f"no usable checkpoint in {self.directory} ({listing}). Nothing was deleted: repair or move the "
            "damaged step directories to start over, or point the run at another directory."
        )

    def set_aside(self, steps: Sequence[int], label: str = "corrupt") -> None:
        """Rename checkpoints to `<step>.<label>` (kept for inspection, never listed or deleted), so that a
        resume skips them and the resumed run can save those steps again. Every process calls it.

        **Arguments:** `steps`, `label` (`"corrupt"`: damaged; `"diverged"`: written after a divergence).
        """
        if is_main_process():
            for s in steps:
                src = self.directory / str(s)
                dst = self.directory / f"{s}.{label}"
                n = 1
                while dst.exists():
                    dst, n = self.directory / f"{s}.{label}{n}", n + 1
                if src.exists():
                    src.rename(dst)
                    logger.warning("moved checkpoint %s to %s", src, dst)
        barrier(f"eqgpt-checkpoint-set-aside-{'-'.join(map(str, steps))}")
        self._manager.reload()


def _os_reason(error: BaseException) -> str | None:
    """`"OSError 28: No space left on device"` from an error (or its causes) that carries an errno."""
    while error is not None:
        if isinstance(error, OSError) and error.errno:
            return f"OSError {error.errno}: {os.strerror(error.errno)}"
        found = re.search(r"os_error_code='?(\d+)", str(error))  # TensorStore's errors carry it in the text
        if found:
            path = re.search(r'Failed writing: "([^"]+)"', str(error))
            return f"OSError {found.group(1)}: {os.strerror(int(found.group(1)))}" + (
                f" writing {path.group(1)}" if path else "")
        error = error.__cause__ or error.__context__
    return None


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    for noise in (" [tensorstore_spec", " See full TensorStore details"):  # long specs say little
        text = text.split(noise)[0]
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


__all__ = [
    "Checkpointer", "Restored", "CheckpointError", "IncompatibleCheckpointError",
    "CorruptCheckpointError", "CheckpointWriteError", "abstract_state", "named_leaves", "checksums",
]
