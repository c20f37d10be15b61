"""Resuming: exactly (bitwise) on the same mesh, within fp32 noise on other meshes, after SIGTERM.

One uninterrupted 20-step fsdp=8 run is the reference; the other runs are cut
at step 10 (or where SIGTERM lands), checkpointed, restored and continued.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from filelock import FileLock

MP = Path(__file__).parent / "mp"
sys.path.insert(0, str(MP.parent))

from eqgpt.data import BatchLoader  # noqa: E402
from eqgpt.parallel import ShardedPlacement, make_mesh  # noqa: E402
from eqgpt.train import SingleDevice  # noqa: E402
from eqgpt.train.checkpoint import Checkpointer  # noqa: E402
from mp.common import TOTAL_STEPS, losses, setup, step_fn, target, trainer  # noqa: E402


def arrays(state):
    leaves = jax.tree.leaves(eqx.filter((state.model, state.opt_state, state.step), eqx.is_array))
    return [np.asarray(x) for x in leaves]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run's losses and final arrays, and checkpoints 5 and 10 of a 10-step run.

    Computed once per test session and shared through files, so that with
    pytest-xdist a second worker loads it instead of compiling it again.
    """
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' base dirs share this session's parent
        base = base.parent
    root = base / "eqgpt-resume-reference"
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            placement, state, step, loader = setup("fsdp=8", "fsdp")
            fresh = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state)  # steps donate
            full = trainer(state, step, loader, placement, steps=TOTAL_STEPS)
            final = full.run()
            first = trainer(fresh, step, loader, placement, steps=10,
                            checkpointer=Checkpointer(root / "ckpt", every=5, keep=3))
            first.run()
            np.savez(root / "final.npz", *arrays(final))
            (root / "losses.json").write_text(json.dumps({"full": losses(full), "first": losses(first)}))
            (root / "done").touch()
    got = json.loads((root / "losses.json").read_text())
    with np.load(root / "final.npz") as f:
        final = [f[f"arr_{i}"] for i in range(len(f.files))]
    return {"dir": root / "ckpt", "losses": got["full"], "first_losses": got["first"], "final": final}


def continue_from(directory, placement, loader=None):
    """Restore the latest checkpoint onto `placement` (None: one device) and train to the end."""
    like = setup("fsdp=8", "fsdp")[1]  # shapes and structure only
    restored = Checkpointer(directory).restore(target(like, placement))
    loader = loader or setup("fsdp=8", "fsdp")[3]
    t = trainer(restored.state, step_fn(), loader, placement or SingleDevice(), steps=TOTAL_STEPS)
    sharding = restored.state.model.blocks.attn.q_proj.weight.sharding  # read before the steps donate it
    return dataclasses.replace(restored, extras={**restored.extras, "sharding": sharding}), t, t.run()


class SignalAt(BatchLoader):
    """A loader that sends this process SIGTERM when the trainer fetches batch `at`."""

    at = 6

    def local_batch(self, step):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().local_batch(step)


def test_exact_resume_and_preemption(reference, tmp_path):
    ref = reference
    # 10 steps + checkpoint + restore + 10 steps == 20 steps, bitwise.
    assert Checkpointer(ref["dir"]).steps() == [5, 10]
    assert ref["first_losses"] == ref["losses"][:10]
    restored, t, final = continue_from(ref["dir"], ShardedPlacement(make_mesh("fsdp=8"), "fsdp"))
    assert restored.step == 10 and restored.extras["data"] == {"seed": 0, "step": 10, "mode": "windows",
                                                             "batch_size": 8, "seq_len": 32}
    assert losses(t) == ref["losses"][10:]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert ref["losses"][-1] < ref["losses"][0]

    # SIGTERM during training: the step in flight finishes, a checkpoint is written, the loop stops.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed from the main thread")
    placement, state, step, base = setup("fsdp=8", "fsdp")
    loader = SignalAt(base.tokens, batch_size=base.batch_size, seq_len=base.seq_len, seed=base.seed)
    before = signal.getsignal(signal.SIGTERM)
    stopped_run = trainer(state, step, loader, placement, steps=TOTAL_STEPS,
                          checkpointer=Checkpointer(tmp_path, every=1000))
    stopped_run.run()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is removed again
    assert stopped_run.interrupted and stopped_run.stop_signal == signal.SIGTERM
    stopped = int(stopped_run.state.step)
    assert stopped == SignalAt.at + 1
    assert Checkpointer(tmp_path).steps() == [stopped]
    restored, resumed, final = continue_from(tmp_path, placement)
    assert restored.step == stopped
    assert losses(stopped_run) + losses(resumed) == ref["losses"]
    for a, b in zip(arrays(final), ref["final"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_elastic_resume(reference):
    """Saved under fsdp=8; continued under data=4,tensor=2 and on one device."""
    ref = reference
    for placement in (ShardedPlacement(make_mesh("data=4,tensor=2"), "dp+tp"), None):
        restored, t, final = continue_from(ref["dir"], placement)
        assert restored.step == 10
        if placement is None:
            assert len(restored.extras['sharding'].device_set) == 1
        else:
            assert restored.extras['sharding'].mesh.shape == placement.mesh.shape
            assert "tensor" in str(restored.extras['sharding'].spec)
        np.testing.assert_allclose(losses(t), ref["losses"][10:], rtol=2e-5)
        for a, b in zip(arrays(final), ref["final"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)  # Adam amplifies noise on ~0 gradients


# --- the recipe: a stopped run continues exactly, a finished one is left alone ------------------------

from recipe_runs import (  # noqa: E402
    TINY,
    console_script,
    load_recipe,
    write_documents,
)

RUN = [*TINY, "--steps", "12", "--log-every", "4", "--eval-every", "6", "--sample-tokens", "6"]


def _recipe_run(tmp_path, name, extra=()):
    """`train_gpt.py` as a user types it (flags parsed as on the command line), in this process."""
    recipe = load_recipe()
    args = [*RUN, "--data.corpus", str(tmp_path / "docs"), "--data.cache-dir", str(tmp_path / "cache"),
            "--out-dir", str(tmp_path / name), *extra]
    return recipe.main(recipe.parse_flags(args))


def _checksums(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _train_rows(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.mark.slow
def test_ctrl_c_then_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """Default flags but a tiny model: SIGINT at step 7 (with --checkpoint-every 0, Grain threads on),
    then --resume ending bitwise where an uninterrupted run ends; metrics hold each step once. The finished
    run then: a plain --resume changes nothing, refused resumes neither (issue 51), the next plain resume
    validates step 12 on the run's own corpus as the run did, and --allow-new-corpus switches, recorded."""
    assert threading.current_thread() is threading.main_thread(), "SIGINT needs the main thread"
    write_documents(tmp_path / "docs")
    recipe = load_recipe()
    assert _recipe_run(tmp_path, "straight")["steps"] == 12

    make_loader = sys.modules[recipe.main.__module__].make_loader

    def interrupting_loader(*args, **kwargs):
        loader = make_loader(*args, **kwargs)
        fetch = loader.local_batch
        loader.local_batch = lambda step: (os.kill(os.getpid(), signal.SIGINT) if step == 6 else None, fetch(step))[1]
        return loader

    monkeypatch.setattr(sys.modules[recipe.main.__module__], "make_loader", interrupting_loader)
    stopped = _recipe_run(tmp_path, "cut")
    monkeypatch.setattr(sys.modules[recipe.main.__module__], "make_loader", make_loader)
    assert stopped["interrupted"] and stopped["steps"] == 7
    resumed = recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(tmp_path / "cut")]))  # flags: the run's
    assert resumed["steps"] == 12 and not resumed["interrupted"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert (cut / "model.eqx").read_bytes() == (straight / "model.eqx").read_bytes()
    assert _train_rows(cut) == _train_rows(straight)  # steps 1, 4, 7 (at the stop), 8, 12: each once
    vals = [r["step"] for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert vals == [0, 6, 7, 12]  # the stop validated step 7 again, once
    assert resumed["first_val_loss"] == json.loads((straight / "summary.json").read_text())["first_val_loss"]
    assert (cut / "samples.txt").read_text() == (straight / "samples.txt").read_text()

    # A finished run: --resume changes nothing; refused resumes neither (below); --steps 14 trains on from step 12.
    before = _checksums(cut)
    again = recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(cut)]))
    assert again["finished"] and _checksums(cut) == before
    val_at_12 = [r["val_loss"] for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines())
                 if r["step"] == 12 and "val_loss" in r]
    _refused_resumes_change_nothing(cut, monkeypatch, capsys)
    more = recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(cut), "--steps", "14"]))
    assert more["steps"] == 14
    steps = [r[0] for r in _train_rows(cut)]
    assert steps == sorted(set(steps)) and steps[-1] == 14
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    again = [r["val_loss"] for r in rows if r["step"] == 12 and "val_loss" in r]
    assert again == val_at_12  # measured again on the run's corpus (another corpus validates otherwise)
    config = json.loads((cut / "config.json").read_text())
    docs = str(tmp_path / "docs")
    assert config["recipe"]["data"]["corpus"] == docs and config["recipe"]["batch_size"] == 8
    assert [c["name"] for c in config["corpora"]] == [docs]

    # A deliberate switch (--allow-new-corpus) trains on, and config.json records it.
    capsys.readouterr()
    recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(cut), "--steps", "16", "--data.corpus", "other",
                                    "--allow-new-corpus"]))
    assert "--allow-new-corpus: continuing on corpus other" in capsys.readouterr().out
    corpora = json.loads((cut / "config.json").read_text())["corpora"]
    assert [(c["name"], c["from_step"]) for c in corpora] == [(docs, 0), ("other", 14)]


# --- a refused resume changes nothing (through the console script's entry) ----------------------------

REFUSED = [  # each differs from the run's checkpoint: the resume is refused before anything is written
    (["--batch-size", "16", "--data.corpus", "stdlib"], ["--batch-size 16", "--data.corpus stdlib"]),
    (["--data.corpus", "other"], ["another corpus", "--allow-new-corpus"]),
    (["--model.embed-dim", "48"], ["--model.embed-dim 48 (the run's: 32)"]),
    (["--seed", "3", "--data.mode", "packed"], ["--seed 3", "--data.mode packed"]),
]


def _refused_resumes_change_nothing(run: Path, monkeypatch, capsys) -> None:
    """Issue 51: `run` (finished at step 12) resumed with flags that contradict its checkpoint (batch size and
    corpus, model width, seed and data mode, another corpus `other` beside it): each is refused in one line with
    exit status 1 and every file of the run keeps its bytes. In this process, through `eqgpt-train`'s entry
    (`eqgpt.cli.train.run`): a refusal comes before any compile, and test_cli_errors shows the same one line
    and status from a fresh process of the console script."""
    import eqgpt.cli.train as train
    from test_cli_errors import refused

    write_documents(run.parent / "other", seed=1)
    monkeypatch.chdir(run.parent)
    monkeypatch.setattr(train, "restart_with_malloc_tunables", lambda: None)
    before = _checksums(run)
    for extra, words in REFUSED:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.run(["--resume", "--out-dir", run.name, "--steps", "16", *extra])
        err = refused(e.value.code, capsys.readouterr().err, extra)
        assert err.startswith("error: --resume: refused, nothing changed") and all(w in err for w in words), err
        assert _checksums(run) == before, extra


def test_a_new_run_never_overwrites_another(tmp_path):
    write_documents(tmp_path / "docs")
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.eqx").write_bytes(b"a trained model")
    with pytest.raises(ValueError, match="--out-dir .* holds another run; add --resume"):
        _recipe_run(tmp_path, "run")
    with pytest.raises(ValueError, match="holds a finished run without checkpoints"):
        _recipe_run(tmp_path, "run", ["--resume"])
    assert [p.name for p in out.iterdir()] == ["model.eqx"]


# --- extending a run continues its learning-rate schedule ---------------------------------------------


def test_schedule_tails_continue_without_a_jump():
    from eqgpt.train.optim import extend_schedule, make_lr_schedule

    base = make_lr_schedule(1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    for start in (60, 100):  # stopped mid-decay, and finished
        for tail, at_end in (("cosine", 0.1), ("linear", 0.1), ("constant", float(base(start)))):
            s = extend_schedule(base, start=start, end=200, final=0.1, tail=tail)
            assert float(s(start - 1)) == float(base(start - 1)) and abs(float(s(start)) - float(base(start))) < 1e-7
            assert abs(float(s(start + 1)) - float(base(start))) < 0.01  # no jump
            np.testing.assert_allclose(float(s(200)), at_end, rtol=1e-6)
    with pytest.raises(ValueError, match="tail must be one of"):
        extend_schedule(base, start=100, end=200, final=0.1, tail="cosign")


@pytest.mark.slow
def test_extending_a_finished_run_continues_its_learning_rate(tmp_path, capsys):
    """200 steps, then --resume --steps 220: the rate at step 201 is within 1% of step 200's (the default
    cosine tail), the log names the tail, and config.json records it."""
    write_documents(tmp_path / "docs")
    recipe = load_recipe()
    args = [*TINY, "--eval-windows", "0", "--log-every", "1", "--optim.warmup-steps", "10",
            "--optim.min-lr-ratio", "0.02", "--data.corpus", str(tmp_path / "docs"),
            "--data.cache-dir", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run")]
    recipe.main(recipe.parse_flags([*args, "--steps", "200"]))
    capsys.readouterr()
    recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(tmp_path / "run"), "--steps", "220"]))
    printed = capsys.readouterr().out
    assert "--steps 220 extends the run's schedule: cosine tail from 6e-05 at step 200" in printed, printed
    lr = {r["step"]: r["lr"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
          if "lr" in r}
    assert sorted(lr) == list(range(1, 221))
    assert abs(lr[201] - lr[200]) <= 0.01 * lr[200] and max(lr[s] for s in range(201, 221)) <= 1.01 * lr[200]
    schedule = json.loads((tmp_path / "run" / "config.json").read_text())["schedule"]
    assert schedule == {"planned_steps": 200, "tails": [{"from": 200, "to": 220, "tail": "cosine"}]}
    recipe.main(recipe.parse_flags(["--resume", "--out-dir", str(tmp_path / "run"), "--steps", "225",
                                    "--optim.lr", "1e-3", "--optim.extend", "constant"]))
    printed = capsys.readouterr().out
    assert "changed on resume: --optim.lr 0.001 (the run's: 0.003); the learning rate at step 220 moves from " \
           "6e-05 to 2e-05" in printed, printed
    assert "constant tail from 2e-05 at step 220" in printed


# --- stoppable: SIGTERM in seconds, Ctrl-C twice without a traceback, a step too big refused ------------

STOP_SCRIPT = """
import os, signal, sys, time
from eqgpt.train.preemption import StopSignal, at_forced_exit
at_forced_exit(lambda: "(the recipe's note)")
with StopSignal() as stop:
    for s in {signals}:
        os.kill(os.getpid(), s)
    time.sleep(60)  # a compile, step or validation that takes no stop: the watcher ends the process
print("not reached")
"""


@pytest.mark.parametrize("signals, code, line", [
    ("[signal.SIGTERM]", 75, "stopped by SIGTERM: the run was inside a compile, step or validation that did not "
                             "end within 1 s. (the recipe's note)"),
    ("[signal.SIGINT, signal.SIGINT]", 130,
     "second Ctrl-C: stopped at once, without a checkpoint. (the recipe's note)"),
])
def test_a_stop_the_loop_cannot_take_ends_the_process_in_one_line(signals, code, line):
    env = {**os.environ, "EQGPT_STOP_GRACE_S": "1"}
    proc = subprocess.run([sys.executable, "-c", STOP_SCRIPT.format(signals=signals)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stdout.strip() == line and "Traceback" not in proc.stderr, (proc.stdout, proc.stderr[-2000:])


def test_a_step_predicted_not_to_fit_is_refused_before_compiling(tmp_path, monkeypatch):
    """--model.seq-len 100000 on a CPU: the estimate (eqgpt.profile.estimate) exceeds the machine's memory;
    one error naming the flags, before any compile, and no directory."""
    recipe = load_recipe()
    np.random.default_rng(0).integers(0, 250, 300_000).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    compiled = []
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: compiled.append(1))
    with pytest.raises(ValueError, match=r"^--model.seq-len 100000 --batch-size 32: the step is predicted to need "
                                         r"[\d.]+ GiB per device .* lower --model.seq-len or --batch-size"):
        recipe.main(recipe.parse_flags(["--model.seq-len", "100000", "--data.corpus", str(tmp_path / "tokens.bin"),
                                        "--data.val-percent", "50", "--out-dir", str(tmp_path / "run"),
                                        "--no-compile-cache"]))
    assert not compiled and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sigterm_inside_a_long_validation_stops_at_once_and_leaves_nothing(tmp_path):
    """SIGTERM (as `timeout -s TERM` sends it) during a first validation of long sequences: the run ends with
    exit status 75 and one line, no traceback, and the new run directory (no step completed) is removed."""
    np.random.default_rng(0).integers(0, 250, 400_000).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    env = {**os.environ, "EQGPT_STOP_GRACE_S": "2"}
    cmd = [*console_script("eqgpt-train"), "--model.seq-len", "2048", "--batch-size", "2", "--eval-windows", "64",
           "--data.corpus", "tokens.bin", "--out-dir", "runs/long", "--no-progress", "--no-compile-cache",
           "--sample-tokens", "0"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # the line before the first validation
        lines.append(line)
        if line.startswith("model nano"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    printed = "".join(lines) + out
    assert proc.returncode == 75, printed + err[-2000:]
    assert "Traceback" not in err and "stopped" in printed and "new run directory runs/long was removed" in printed
    assert not (tmp_path / "runs" / "long").exists() and not (tmp_path / "runs" / "latest").is_symlink()
