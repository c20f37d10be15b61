"""Bad flags end in one line naming the flag a user typed, exit status 1, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tyro

from eqgpt.parallel.flags import tyro_registry
from recipe_runs import RECIPES, load_recipe

BAD_TRAIN_FLAGS = [
    (["--optim.lr", "-1"], "--optim.lr"),
    (["--optim.lr", "nan"], "--optim.lr"),
    (["--optim.b2", "1.5"], "--optim.b2"),
    (["--optim.warmup-steps", "-3"], "--optim.warmup-steps"),
    (["--optim.min-lr-ratio", "2"], "--optim.min-lr-ratio"),
    (["--data.val-percent", "100"], "--data.val-percent"),
    (["--model.seq-len", "0"], "--model.seq-len"),
    (["--model.capacity-factor", "0"], "--model.capacity-factor"),
    (["--z-loss", "-1"], "--z-loss"),
    (["--batch-size", "6", "--accum-steps", "4"], "--accum-steps"),
    (["--steps", "0"], "--steps"),
    (["--cpu-devices", "0"], "--cpu-devices"),
    (["--profile-steps", "5", "2"], "--profile-steps"),
]


@pytest.mark.parametrize("args, flag", BAD_TRAIN_FLAGS, ids=[" ".join(a) for a, _ in BAD_TRAIN_FLAGS])
def test_numeric_train_flags_are_refused_naming_the_flag(args, flag):
    recipe = load_recipe()
    with pytest.raises(ValueError, match=flag) as e:
        recipe.check_run_flags(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=args))
    assert "\n" not in str(e.value) and "_" not in str(e.value).split(",")[0].split(" must")[0]


def one_line_error(cmd: list[str], cwd: Path) -> str:
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    return proc.stderr.strip()


def test_train_errors_are_one_line_with_exit_1(tmp_path):
    (tmp_path / "file").write_text("")
    err = one_line_error([str(RECIPES / "train_gpt.py"), "--optim.lr", "-1"], tmp_path)
    assert err.startswith("error: --optim.lr must be above 0")
    err = one_line_error([str(RECIPES / "train_gpt.py"), "--out-dir", "file/run"], tmp_path)
    assert "--out-dir file/run" in err
    assert not (tmp_path / "runs").exists()


def test_sample_errors_are_one_line_with_exit_1(tmp_path):
    sample = str(RECIPES / "sample.py")
    assert "--top-k" in one_line_error([sample, "--top-k", "0"], tmp_path)
    assert "--run-dir" in one_line_error([sample, "--run-dir", "nowhere"], tmp_path)
    assert "--hf" in one_line_error([sample, "--hf", "nowhere"], tmp_path)
    (tmp_path / "run").mkdir()
    assert "model_config.json not found" in one_line_error([sample, "--run-dir", "run"], tmp_path)
    import jax

    from eqgpt.nn import GPT
    from eqgpt.train import save_model
    from helpers import TINY

    save_model(tmp_path / "saved", GPT(TINY, key=jax.random.key(0)))
    err = one_line_error([sample, "--run-dir", "saved", "--block", "nope:thing"], tmp_path)
    assert "--block nope:thing: cannot import 'nope'" in err


def test_parallel_errors_suggest_a_mesh_that_fits_the_flag(monkeypatch):
    import jax

    from eqgpt.nn import GPT
    from eqgpt.parallel import ParallelFlags
    from helpers import TINY

    with pytest.raises(ValueError, match=r"context needs a mesh, e\.g\. --mesh context=2,data=2"):
        ParallelFlags.parse("", "dp", context="ring")
    model = jax.eval_shape(lambda k: GPT(TINY, key=k), jax.random.key(0))
    with pytest.raises(ValueError, match=r"--context ring splits the sequence .* --mesh data=8 has none"):
        ParallelFlags.parse("data=8", "dp", context="ring").check(model, batch_size=8, seq_len=32)
    recipe = load_recipe()
    monkeypatch.setattr(jax, "devices", lambda *a: jax.local_devices()[:1])  # a CPU without --cpu-devices
    with pytest.raises(ValueError, match=r"^--mesh data=8: .* --cpu-devices 8 --mesh data=8"):
        recipe.strategy_of(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=["--mesh", "data=8"]))


def test_library_messages_get_the_flags_they_are_about():
    from eqgpt.cli import one_line

    args = ["--steps", "3", "--model.remat", "bogus", "--microbatches=0", "--no-progress"]
    assert one_line(ValueError("Unknown remat 'bogus'."), args) == "error: --model.remat bogus: Unknown remat 'bogus'."
    assert (one_line(ValueError("microbatches must be\n >= 1"), args)
            == "error: --microbatches 0: microbatches must be >= 1")
    assert one_line(ValueError("--steps 3 is too few"), args) == "error: --steps 3 is too few"  # names its flag already
