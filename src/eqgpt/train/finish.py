"""The end of a run: the model saved, samples generated, the loss plotted and the summary written.

A run stopped by a fault keeps its last good checkpoint and writes only its summary; one
stopped by SIGTERM leaves at once (its checkpoint, or, when it reached none, nothing).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from eqgpt import distributed
from eqgpt.profile.compiles import CompileLog
from eqgpt.sample import generate_texts, on_one_device
from eqgpt.train.ahead import Ahead
from eqgpt.train.export import save_model
from eqgpt.train.plot import plot_history
from eqgpt.train.preemption import PREEMPTED_EXIT_CODE
from eqgpt.train.run_dir import committed_steps
from eqgpt.train.state import TrainState
from eqgpt.train.trainer import Trainer


def sample_inputs(state: TrainState, *, tokenizer: Any, prompts: Sequence[str], max_new: int,
                  seq_len: int) -> tuple | None:
    """`generate_texts`'s arguments for `prompts` (up to `max_new` new tokens each, within `seq_len`)
    from `state`'s model on one device, and its key; `None` when there is nothing to sample."""
    n_new = min(max_new, seq_len - max((len(tokenizer.encode(p)) for p in prompts), default=0))
    if n_new < 1 or not prompts:
        return None
    # Generation's layout, whatever mesh and strategy trained it; scanned: it compiles one layer.
    model = on_one_device(state.model).scanned()
    rng = jax.device_put(state.rng.addressable_data(0), jax.local_devices()[0])  # replicated: this process's copy
    return (model, tokenizer, prompts, n_new), rng


def sample(inputs: tuple | None, compiled: Any = None) -> list[str]:
    """Generate from `sample_inputs`'s `inputs` (KV cache, one device's view, one batch: prompt i
    draws with fold_in(rng, i)); `compiled`: the program `compile_ahead` made."""
    return [] if inputs is None else generate_texts(*inputs[0], key=inputs[1], compiled=compiled)


def finish(trainer: Trainer, state: TrainState, out: Path, *, tokenizer: Any, title: str, checkpoint_dir: Path,
           sampler: Callable[[TrainState], tuple | None] | None, t0: float, leave: Callable[[], str],
           compiles: CompileLog | None = None, ahead: Ahead | None = None) -> dict:
    """Save the model (and `tokenizer`), plot (under `title`), sample (`sampler(state)`: `sample_inputs`;
    `None`: no samples) and summarise; **returns** the summary. A run stopped by SIGTERM leaves at once:
    its checkpoint in `checkpoint_dir`, or (a new run that completed no step) nothing (`leave`)."""
    is_main = distributed.is_main_process()
    summary = {"steps": int(state.step), "skipped": int(state.skipped), "interrupted": trainer.interrupted}
    if trainer.fault is not None:  # non-finite or diverged: the last good state is saved; nothing to export
        summary.update(stopped=trainer.fault.reason, exit_code=trainer.fault.code,
                       seconds=trainer.seconds_before + time.perf_counter() - t0)
        if is_main:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    if trainer.stop_signal == signal.SIGTERM:  # preempted: the checkpoint is written; leave within the grace
        summary["seconds"] = trainer.seconds_before + time.perf_counter() - t0
        if is_main and committed_steps(checkpoint_dir):
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if is_main:
            print(f"stopped at step {summary['steps']} by SIGTERM (exit status {PREEMPTED_EXIT_CODE}). {leave()}",
                  flush=True)
        return summary
    # from host memory if offloaded
    state = eqx.tree_at(lambda s: s.model, state, trainer.placement.on_device(state.model))
    save_model(out, state.model)
    if is_main:
        tokenizer.save(out)  # tokenizer.json: what recipes/sample.py and eqgpt.interop decode with
    compiled = ahead and ahead.get("sample") if sampler is not None else None  # waits for its compile
    samples = sample(sampler(state), compiled) if sampler is not None else []
    trainer.log_samples(summary["steps"], samples)
    _, vals = trainer.history.series("val_loss")
    summary.update(val_loss=vals[-1] if vals else None, first_val_loss=vals[0] if vals else None,
                   seconds=trainer.seconds_before + time.perf_counter() - t0, samples=samples)
    if compiles is not None:
        summary["compile_seconds"] = compiles.phases()
    if is_main:
        plot_history(trainer.history, out / "loss.png", title=title)
        (out / "samples.txt").write_text("".join(f"--- sample {i} ---\n{s}\n" for i, s in enumerate(samples)))
        print("".join(f"--- sample {i} ---\n{s}\n" for i, s in enumerate(samples)), end="")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _, bpb = trainer.history.series("val_bpb")
        val = f"val loss {vals[0]:.3f} -> {vals[-1]:.3f} nats/token " if vals else ""
        val += f"({bpb[0]:.3f} -> {bpb[-1]:.3f} bits/byte) " if bpb else ""
        print(f"done: {val}in {summary['seconds'] / 60:.1f} min; outputs in {out}/")
        if compiles is not None:
            print(compiles.summary())
    return summary


__all__ = ["finish", "sample", "sample_inputs"]
