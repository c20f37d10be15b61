"""What a resume checks before it writes anything: that the checkpoint it continues was written by
this model, on this data pipeline and on this corpus.

A checkpoint saves the run's configuration (`model`, `corpus`, ...) and its data state (seed,
mode, batch size, sequence length). `check_resume` compares them with the resuming run and
raises one `IncompatibleCheckpointError` naming every flag that differs, so a refused resume
changes no file of the run. A different corpus (another fingerprint of its token arrays) is
refused unless asked for (`allow_new_corpus`); the same tokens under another path are the same
corpus, moved.

`newest_checkpoint` runs that check on the newest checkpoint's record before anything
compiles; `restore_run` restores the latest good checkpoint the check accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax

from eqgpt import distributed
from eqgpt.train.checkpoint import Checkpointer, IncompatibleCheckpointError, Restored
from eqgpt.train.state import TrainState

DATA_FIELDS = ("seed", "mode", "batch_size", "seq_len")  # of a loader's state: fix every batch of a run


def corpus_record(name: str, fingerprint: str) -> dict:
    """A corpus as checkpoints and `config.json` record it."""
    return {"name": str(name), "fingerprint": fingerprint}


def check_resume(step: int, saved: Mapping, extras: Mapping, *, model: Mapping, data: Mapping,
                 corpus: Mapping | None, flags: Mapping[str, str], allow_new_corpus: bool = False,
                 switch_flag: str = "--allow-new-corpus") -> list[str]:
    """Check checkpoint `step`'s record against the resuming run; **returns** notes for the log.

    **Arguments:** `saved`, `extras` (the checkpoint's config and extras,
    `Checkpointer.saved_record`); `model` (this run's `GPTConfig.architecture()`); `data` (its
    loader state); `corpus` (its `corpus_record`); `flags` (field -> the flag that sets it, e.g.
    `"batch_size": "--batch-size"`, `"model.embed_dim": "--model.embed-dim"`);
    `allow_new_corpus`: accept another corpus (and `switch_flag` names the flag that says so).

    **Raises** `IncompatibleCheckpointError` naming every flag that differs from the checkpoint.
    """
    problems, notes = [], []

    def differ(field: str, was, now) -> None:
        flag = flags.get(field)
        name = f"{flag} {now}" if flag else f"{field} {now!r}"
        problems.append(f"{name} (the run's: {was})")

    for key in sorted(set(saved.get("model") or {}) | set(model)):
        was, now = (saved.get("model") or {}).get(key), model.get(key)
        if "model" in saved and was != now:
            differ(f"model.{key}", was, now)
    saved_data = extras.get("data") or {}
    for key in DATA_FIELDS:
        if key in saved_data and key in data and saved_data[key] != data[key]:
            differ(key, saved_data[key], data[key])
    if corpus is not None:
        was = saved.get("corpus")
        if was is None:  # a checkpoint from before corpus records: its flags name the corpus
            name = ((saved.get("recipe") or {}).get("data") or {}).get("corpus")
            was = None if name is None else {"name": name, "fingerprint": None}
        if was is not None and was.get("fingerprint") not in (None, corpus["fingerprint"]) or (
                was is not None and was.get("fingerprint") is None and was["name"] != corpus["name"]):
            if allow_new_corpus:
                notes.append(f"{switch_flag}: continuing on corpus {corpus['name']} (fingerprint "
                             f"{corpus['fingerprint']}); the run trained on {was['name']} until step {step}")
            else:
                problems.append(f"{flags.get('corpus', 'corpus')} {corpus['name']}, another corpus (the run's: "
                                f"{was['name']}; token fingerprints {corpus['fingerprint']} and "
                                f"{was.get('fingerprint') or 'unrecorded'}; {switch_flag} switches on purpose)")
        elif was is not None and was["name"] != corpus["name"]:
            notes.append(f"corpus {corpus['name']}: the same tokens as the run's {was['name']} (moved)")
    if problems:
        raise IncompatibleCheckpointError(
            f"--resume: refused, nothing changed; these differ from the run's checkpoint {step}: "
            f"{'; '.join(problems)}. Leave them out to continue the run as it was, or start a new run in "
            "another --out-dir.")
    return notes


def corpora_trained(out: Path, corpus: Mapping, step: int, *, resume: bool) -> list[dict]:
    """config.json's `corpora`: every corpus the run in `out` has trained on (`corpus_record`s), each with
    the step it began at; `corpus`, this run's, is added at `step` when it is another (--allow-new-corpus)."""
    saved = out / "config.json"
    history = json.loads(saved.read_text()).get("corpora") or [] if resume and saved.is_file() else []
    if not history or history[-1].get("fingerprint") != corpus["fingerprint"]:
        history.append({**corpus, "from_step": step if history else 0})
    return history


def newest_checkpoint(checkpoint_dir: Path, check: Callable[[int, dict, dict], None]) -> int | None:
    """The newest checkpoint's record in `checkpoint_dir` checked (`check(step, saved, extras)`) early,
    before any compile; a record that cannot be read is left to `restore_run`, which falls back past it.
    **Returns** the newest checkpoint's step (`None`: none)."""
    if not checkpoint_dir.is_dir():
        return None
    checkpointer = Checkpointer(checkpoint_dir)
    step = checkpointer.latest_step()
    try:
        record = checkpointer.saved_record(step) if step is not None else None
    except Exception:  # noqa: BLE001 - damage: restore names it and falls back
        record = None
    if record is not None:
        check(step, *record)
    return step


def restore_run(checkpoint_dir: Path | None, state: TrainState, loader: Any, check: Callable[[int, dict, dict], None],
                log: Callable[[str], None], *, strict: bool = False, allow_fresh: bool = False) -> Restored | None:
    """The latest good checkpoint in `checkpoint_dir` (`None`: not resuming) that `check` accepts,
    restored into `state`'s layout (any mesh, any strategy), and the loader's iterator state with it;
    writes nothing (but for setting aside damaged checkpoints it passed over); `strict`, `allow_fresh`:
    as `Checkpointer.restore`. **Returns** the `Restored`, or `None` (start at step 0)."""
    if jax.process_count() > 1:
        distributed.check_replicas_agree(state.model)
    if checkpoint_dir is None:
        return None
    checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir.is_dir() else None  # never create it here
    restored = (checkpointer.restore(state, strict=strict, allow_fresh=allow_fresh, check=check)
                if checkpointer is not None else None)
    if restored is not None:
        log(f"resumed from checkpoint {restored.step} in {checkpointer.directory}")
        if "data" in restored.extras:
            loader.restore(restored.extras["data"])
        return restored
    # (with traces of earlier checkpoints, only after --allow-fresh: restore refuses otherwise)
    traces = checkpointer.traces() if checkpointer is not None else []
    log(f"--resume: no complete checkpoint in {checkpoint_dir}" + (f" (traces: {', '.join(traces)})" if traces else "")
        + "; starting at step 0")
    return None


__all__ = ["DATA_FIELDS", "check_resume", "corpora_trained", "corpus_record", "newest_checkpoint", "restore_run"]
