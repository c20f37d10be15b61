"""Faults, each injected: corrupt checkpoints, NaN batches and divergence, killed saves, a full disk.

(Bad token ids are refused by `load_corpus`: tests/test_data.py::test_token_file_vocabulary_from_flag_sidecar_or_ids.
A dead rank under `python -m eqgpt.launch`:
tests/test_multiprocess.py::test_dead_rank_stops_the_job_and_resumes_on_fewer_devices;
corrupt files found by one process of two: tests/test_multiprocess.py::test_two_processes_match_one.)
"""

import logging
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.parallel.flags import tyro_registry
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
    with pytest.raises(CorruptCheckpointError,
                       match=rf"checkpoint 20 in .* is corrupt \(.*{damaged.name}.*\)\. Strict"):
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


# --- stops: too many skipped updates, divergence ------------------------------------------------


def _arrays(state):
    import equinox as eqx
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))]


def test_guards_stop_with_their_codes_and_save_the_last_good_state(tmp_path, capsys):
    """NaN batches (3 in a row, --max-skipped 3) and a learning-rate spike (real divergence, K=3)
    stop the Trainer with exit codes 76 and 77; the checkpoint holds the state of the last good step."""
    import dataclasses

    import jax
    import optax

    from eqgpt.data import BatchLoader
    from eqgpt.train import SingleDevice, Trainer, TrainerConfig, TrainState, make_train_step
    from eqgpt.train.guards import DIVERGED_EXIT_CODE, NON_FINITE_EXIT_CODE
    from mp.common import CONFIG, corpus, host_model

    nan_steps, spike_at, window = (5, 6, 7), 8, 3

    class Masked(BatchLoader):  # every batch carries a loss mask; NaN in it at `nan_steps`
        poisoned = ()

        def local_batch(self, step):
            b = super().local_batch(step)
            mask = np.full(b.tokens.shape, np.nan if step in self.poisoned else 1.0, np.float32)
            return dataclasses.replace(b, loss_mask=mask)

    def run(optimizer, steps, poisoned=(), directory=None, **guards):
        model = jax.device_put(host_model())
        state = TrainState(model, optimizer.init(model), rng=jax.random.key(1))
        loader = Masked(corpus(), batch_size=8, seq_len=CONFIG.seq_len, seed=0)
        loader.poisoned = poisoned
        ckpt = None if directory is None else Checkpointer(directory, every=5, keep=20)
        config = TrainerConfig(steps=steps, log_every=1, eval_every=0, progress=False, **guards)
        t = Trainer(_STEPS[optimizer], state, loader, SingleDevice(), config=config, checkpointer=ckpt)
        return t, t.run()

    # One optimizer (one compiled step) for both: its learning rate spikes to 30 at step 8 only.
    spiky = optax.adam(lambda step: jnp.where(step == spike_at, 30.0, 1e-3))
    _STEPS = {spiky: make_train_step(spiky)}

    # Non-finite: steps 5, 6, 7 skipped -> stop after 8 steps; parameters are those after step 4.
    t, final = run(spiky, 20, nan_steps, tmp_path / "nan", max_skipped=3)
    assert t.fault.code == NON_FINITE_EXIT_CODE == 76 and t.fault.step == 8 and "3 updates in a row" in t.fault.message
    assert "stopped after step 8" in capsys.readouterr().out
    restored = Checkpointer(tmp_path / "nan").restore(final)
    assert restored.step == 8 and int(restored.state.skipped) == 3 and int(restored.state.step) == 8
    _, good = run(spiky, nan_steps[0])  # uninterrupted, to the last good update
    for a, b in zip(_arrays(restored.state), _arrays(good), strict=True):
        np.testing.assert_array_equal(a, b)

    # Divergence: the update of step 8 uses lr 30; losses of steps 9, 10, 11 are far above the mean.
    t, final = run(spiky, 20, directory=tmp_path / "div", divergence_factor=1.5, divergence_window=window)
    assert t.fault.code == DIVERGED_EXIT_CODE == 77 and t.fault.step == spike_at + 1 + window
    assert t.fault.good_step == spike_at + 1 and int(final.step) == spike_at + 1
    ck = Checkpointer(tmp_path / "div")
    assert ck.steps() == [5, 9]  # checkpoint 10 (diverged) is set aside, not deleted
    assert [p.name for p in (tmp_path / "div").glob("*.diverged")] == ["10.diverged"]
    restored = ck.restore(final)
    _, good = run(spiky, spike_at + 1)
    for a, b in zip(_arrays(restored.state), _arrays(good), strict=True):
        np.testing.assert_array_equal(a, b)

    # Bad settings are refused, naming the flag.
    from eqgpt.train.guards import Guard

    for kw, flag in (({"max_skipped": -1}, "--max-skipped"), ({"divergence_factor": 0.5}, "--divergence-factor"),
                     ({"divergence_window": 0}, "--divergence-window")):
        with pytest.raises(ValueError, match=flag):
            Guard(**kw)


# --- SIGKILL at 6 moments of a run that checkpoints every step ---------------------------------


@pytest.mark.slow  # ~15 s of CPU: 8 forked training processes (the suite runs it)
def test_killed_during_saves_resumes_bitwise(tmp_path):
    """6 seeded SIGKILLs (tests/mp/kill_loop.py; attempt 0 dies mid-save, the others at random moments):
    every resume takes the newest complete checkpoint, never a partial one, and every loss after
    it is bitwise the uninterrupted run's."""
    import json
    import subprocess

    kills = 6
    proc = subprocess.run([sys.executable, str(HERE / "mp" / "kill_loop.py"), str(tmp_path), str(kills), "0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line.split(" ", 1)[1])
    events, resumes = got["events"], {int(a): r for a, r in got["resumes"].items()}
    assert len(events) == kills
    # Attempt 0 died inside its first save: the next attempt said so and refused to start afresh unasked.
    assert events[0]["partial"] and not events[0]["committed"]
    refusal = got["refusals"][0]  # (refusals happen only while nothing is complete)
    assert "no complete checkpoint in" in refusal and "only traces of earlier ones (1.orbax-checkpoint-tmp" in refusal
    assert resumes[2]["step"] == -1  # asked: attempt 2 started at step 0
    # Every resume took the newest step committed when the previous attempt died, with nothing skipped:
    # partial writes are never listed, and every listed checkpoint verified intact.
    for event in events:
        nxt = event["attempt"] + 1
        nxt += nxt not in resumes  # a refusal in between
        assert resumes[nxt] == {"step": event["committed"][-1] if event["committed"] else -1, "skipped": 0}, event
    mid_write = sum(bool(e["partial"]) for e in events)
    print(f"\n{kills} kills, {mid_write} mid-write (a partial checkpoint directory on disk), "
          f"{len({e['committed'][-1] for e in events if e['committed']})} distinct resume points, "
          f"loop {got['loop_seconds']:.1f} s")
    assert mid_write >= 1
    # Bitwise: every loss any attempt logged equals the uninterrupted run's at that step.
    reference = {int(s): v for s, v in got["reference"].items()}
    compared = 0
    for attempt, run in got["losses"].items():
        for step, loss in run.items():
            assert loss == reference[int(step)], (attempt, step, loss, reference[int(step)])
            compared += 1
    assert compared > len(reference) and max(reference) >= kills  # resumed steps were replayed and compared


# --- a full disk ---------------------------------------------------------------------------------


def _can_mount_tmpfs(directory: Path) -> bool:
    import shutil
    import subprocess

    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs '{directory}'"], capture_output=True)
    return probe.returncode == 0


def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path):
    """A save into a full file system: a real 1 MiB tmpfs filled up (mounted in a user namespace), or where
    namespaces are not allowed, a file-size limit that fails every larger write the same way (EFBIG)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    script = f"{sys.executable} {HERE / 'mp' / 'disk_full.py'} '{mount}'"
    if _can_mount_tmpfs(mount):
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                   f"mount -t tmpfs -o size=1m tmpfs '{mount}' && exec {script} tmpfs"]
        reason = "No space left on device"
    else:
        command, reason = ["sh", "-c", f"exec {script} fsize"], "File too large"
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    error = next(line for line in out.splitlines() if line.startswith("ERROR "))
    assert "could not write checkpoint 2" in error and reason in error, error
    assert "checkpoint 1 (the newest before it) is intact and restorable" in error and "--resume" in error
    assert "RESTORED 1" in out  # checked against files.json and the array checksums, nothing skipped


# --- through recipes/train_gpt.py ----------------------------------------------------------------


def test_recipe_flags_stop_code_and_strict_resume(tmp_path, capsys):
    """--max-skipped through the recipe (a learning rate so large that the model breaks down after one
    update: every later loss is non-finite): status 76, checkpoint of the last good state; then
    --resume --strict refuses a corrupt newest checkpoint, and flags that cannot apply are refused."""
    import tyro

    from eqgpt.train.guards import NON_FINITE_EXIT_CODE
    from recipe_runs import TINY, load_recipe, write_documents

    recipe = load_recipe()
    out = tmp_path / "run"
    base = [*TINY, "--data.corpus", str(write_documents(tmp_path / "docs", n=40)), "--data.cache-dir",
            str(tmp_path / "cache"), "--data.threads", "0", "--eval-windows", "0", "--out-dir", str(out)]
    for bad, flag in ((["--strict"], "--strict applies to --resume only"),
                      (["--allow-fresh"], "--allow-fresh applies to --resume only"),
                      (["--divergence-factor", "0.9"], "--divergence-factor must be above 1")):
        with pytest.raises(ValueError, match=flag):
            recipe.main(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=[*base, *bad]))
    assert not out.exists()  # refused before anything was written

    args = [*base, "--steps", "12", "--checkpoint-every", "4", "--max-skipped", "3", "--optim.lr", "1e30",
            "--optim.clip-norm", "0"]
    summary = recipe.main(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=args))
    printed = capsys.readouterr().out
    assert summary["exit_code"] == NON_FINITE_EXIT_CODE and summary["stopped"] == "non-finite", printed[-2000:]
    assert "stopped after step 4: 3 updates in a row were skipped" in printed and "exit status 76" in printed
    ckpt = Checkpointer(out / "checkpoints")
    assert ckpt.steps() == [4] and summary["skipped"] == 3 and not (out / "model.eqx").exists()

    # The newest checkpoint damaged: --resume --strict refuses, naming the step and the file.
    damaged = corrupt("flipped bytes", out / "checkpoints" / "4")
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint 4 in .* is corrupt \(.*{damaged.name}"):
        recipe.main(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=[*args, "--resume", "--strict"]))
