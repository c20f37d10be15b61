"""What a resume checks before it writes anything: that the checkpoint it continues was written by
this model, on this data pipeline and on this corpus.

A checkpoint saves the run's configuration (`model`, `corpus`, ...) and its data state (seed,
mode, batch size, sequence length). `check_resume` compares them with the resuming run and
raises one `IncompatibleCheckpointError` naming every flag that differs, so a refused resume
changes no file of the run. A different corpus (another fingerprint of its token arrays) is
refused unless asked for (`allow_new_corpus`); the same tokens under another path are the same
corpus, moved.
"""

from __future__ import annotations

from collections.abc import Mapping

from eqgpt.train.checkpoint import IncompatibleCheckpointError

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


__all__ = ["DATA_FIELDS", "check_resume", "corpus_record"]
