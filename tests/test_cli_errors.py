"""Bad flags end in one line naming the flag a user typed, exit status 1, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tyro

from eqgpt.cli import USER_ERROR_EXIT_CODE
from eqgpt.parallel.flags import tyro_registry
from recipe_runs import RECIPES, console_script, load_recipe

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


def refused(code: int, err: str, what) -> str:
    """A refusal as every command gives one: exit status `USER_ERROR_EXIT_CODE` and one line
    `error: ...`, no traceback; **returns** that line (`what` names the case in a failure)."""
    err = err.strip()
    assert code == USER_ERROR_EXIT_CODE, (what, err[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, (what, err[-2000:])
    return err


def one_line_error(cmd: list[str], cwd: Path) -> str:
    """The one line a command (`[program, *args]`, a Python script when it ends in .py) refuses with."""
    cmd = [sys.executable, *cmd] if cmd[0].endswith(".py") else cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)
    return refused(proc.returncode, proc.stderr, cmd[1:])


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


# --- no debris: a refused run leaves no directory (through the console script) ------------------------


@pytest.mark.slow
def test_refused_runs_leave_no_directory(tmp_path):
    """A token file without document boundaries under --data.mode packed, an empty --out-dir (an unset
    shell variable) and a binary single file as a text corpus: one line each, exit 1, nothing created."""
    import numpy as np

    np.random.default_rng(0).integers(0, 200, 5000).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "noise.txt").write_bytes(bytes(range(256)) * 64)  # a NUL in its first 8 KiB
    cases = [(["--data.corpus", "tokens.bin", "--data.mode", "packed", "--out-dir", "runs/p"], "--data.mode packed"),
             (["--out-dir", ""], "--out-dir is empty"),
             (["--data.corpus", "noise.txt"], "is binary")]
    before = sorted(p.name for p in tmp_path.iterdir())
    for args, words in cases:
        err = one_line_error([*console_script("eqgpt-train"), "--model.seq-len", "16", "--no-compile-cache",
                              "--data.cache-dir", str(tmp_path / "cache"), *args], tmp_path)
        assert words in err, (args, err)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before, args


def test_runs_latest_follows_any_run_under_runs(tmp_path, monkeypatch):
    from eqgpt.train.run_dir import point_latest, under_root

    monkeypatch.chdir(tmp_path)
    assert under_root("runs/mine") and under_root(tmp_path / "runs" / "x") and under_root("./runs/y/")
    assert not under_root("elsewhere/mine") and not under_root("runs/a/b") and not under_root("runs")
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    point_latest("runs/mine")
    assert (tmp_path / "runs" / "latest").resolve() == (tmp_path / "runs" / "mine").resolve()


def test_sample_says_which_run_it_loads_and_why(tmp_path, monkeypatch, capsys):
    import jax

    from eqgpt.nn import GPT
    from eqgpt.train import save_model
    from eqgpt.train.run_dir import point_latest
    from helpers import TINY

    monkeypatch.chdir(tmp_path)
    save_model(tmp_path / "runs" / "mine", GPT(TINY, key=jax.random.key(0)))
    point_latest(tmp_path / "runs" / "mine")
    from eqgpt.cli.sample import SampleConfig
    from eqgpt.cli.sample import main as sample_main

    sample_main(SampleConfig(prompt="ab", max_new_tokens=2, num_samples=1))
    out = capsys.readouterr().out
    assert f"loading run {(tmp_path / 'runs' / 'mine').resolve()} (runs/latest: the newest run" in out
    assert "a run elsewhere needs --run-dir" in out


# --- wrong inputs, table-driven: one line, the shared exit status, no file left (in process) --------------

# (flags, what the one line must contain). Each is appended to BASE (a tiny model on a tiny corpus), so that a
# flag the checks miss would train (and fail the test), never hang.
WRONG_TRAIN = [
    # unknown flags, values of the wrong type or choice, missing values (tyro's errors, one line)
    (["--stepz", "3"], "did you mean --steps"),
    (["--model.embed-dimm", "64"], "did you mean --model.embed-dim"),
    (["--optim.lrr", "1"], "did you mean --optim.lr"),
    (["--data.corpuss", "x"], "did you mean --data.corpus"),
    (["--steps", "abc"], "--steps"),
    (["--batch-size", "big"], "--batch-size"),
    (["--seed", "1.5"], "--seed"),
    (["--optim.lr", "fast"], "--optim.lr"),
    (["--precision", "fp8"], "--precision"),
    (["--log", "wandb"], "--log"),
    (["--model.norm", "batchnorm"], "--model.norm"),
    (["--model.mlp", "relu"], "--model.mlp"),
    (["--model.position", "alibi"], "--model.position"),
    (["--data.mode", "stream"], "--data.mode"),
    (["--optim.mu-dtype", "fp16"], "--optim.mu-dtype"),
    (["--optim.extend", "jump"], "--optim.extend"),
    (["--model.preset"], "--model.preset"),
    (["--profile-steps", "5"], "--profile-steps"),
    # counts and numbers out of range
    (["--steps", "0"], "--steps"),
    (["--steps", "-5"], "--steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--accum-steps", "0"], "--accum-steps"),
    (["--batch-size", "6", "--accum-steps", "4"], "--accum-steps"),
    (["--log-every", "0"], "--log-every"),
    (["--checkpoint-keep", "0"], "--checkpoint-keep"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--eval-windows", "-1"], "--eval-windows"),
    (["--sample-tokens", "-1"], "--sample-tokens"),
    (["--profile-steps", "5", "2"], "--profile-steps"),
    (["--profile-steps", "-1", "2"], "--profile-steps"),
    (["--z-loss", "-1"], "--z-loss"),
    (["--z-loss", "nan"], "--z-loss"),
    (["--peak-flops", "0"], "--peak-flops"),
    (["--peak-flops", "nan"], "--peak-flops"),
    (["--seed", "-1"], "--seed"),
    (["--cpu-devices", "0"], "--cpu-devices"),
    (["--optim.lr", "-1"], "--optim.lr"),
    (["--optim.lr", "0"], "--optim.lr"),
    (["--optim.lr", "nan"], "--optim.lr"),
    (["--optim.lr", "inf"], "--optim.lr"),
    (["--optim.warmup-steps", "-3"], "--optim.warmup-steps"),
    (["--optim.min-lr-ratio", "2"], "--optim.min-lr-ratio"),
    (["--optim.min-lr-ratio", "-0.1"], "--optim.min-lr-ratio"),
    (["--optim.weight-decay", "-1"], "--optim.weight-decay"),
    (["--optim.b1", "1"], "--optim.b1"),
    (["--optim.b1", "-0.5"], "--optim.b1"),
    (["--optim.b2", "1.5"], "--optim.b2"),
    (["--optim.clip-norm", "-1"], "--optim.clip-norm"),
    (["--data.val-percent", "100"], "--data.val-percent"),
    (["--data.val-percent", "-1"], "--data.val-percent"),
    (["--data.val-percent", "0"], "--data.val-percent must be in (0, 100)"),
    (["--data.corpus", "odd.bin"], "an odd number: a .bin token file is uint16"),
    (["--data.cache-dir", "/proc/nope"], "--data.cache-dir (or EQGPT_CACHE)"),
    (["--data.threads", "-1"], "--data.threads"),
    (["--data.prefetch", "0"], "--data.prefetch"),
    (["--model.seq-len", "0"], "--model.seq-len"),
    (["--model.num-layers", "0"], "--model.num-layers"),
    (["--model.num-heads", "0"], "--model.num-heads"),
    (["--model.embed-dim", "0"], "--model.embed-dim"),
    (["--model.num-kv-heads", "0"], "--model.num-kv-heads"),
    (["--model.mlp-dim", "0"], "--model.mlp-dim"),
    (["--model.window", "0"], "--model.window"),
    (["--model.vocab-size", "0"], "--model.vocab-size"),
    (["--model.num-experts", "0"], "--model.num-experts"),
    (["--model.top-k", "0"], "--model.top-k"),
    (["--model.capacity-factor", "0"], "--model.capacity-factor"),
    (["--model.capacity-factor", "-1"], "--model.capacity-factor"),
    (["--max-skipped", "-1"], "--max-skipped"),
    (["--divergence-factor", "-1"], "--divergence-factor"),
    (["--divergence-window", "0"], "--divergence-window"),
    # the model's shape
    (["--model.preset", "nosuch"], "--model.preset nosuch"),
    (["--model.embed-dim", "30", "--model.num-heads", "4"], "--model.embed-dim 30"),
    (["--model.num-kv-heads", "3"], "--model.num-kv-heads 3"),
    (["--model.attention-kernel", "nosuch"], "--model.attention-kernel nosuch"),
    (["--model.block", "nosuch:thing"], "--model.block nosuch:thing"),
    (["--model.remat", "bogus"], "--model.remat bogus"),
    (["--model.vocab-size", "10"], "--model.vocab-size 10"),
    (["--model.seq-len", "100000", "--batch-size", "32", "--data.val-percent", "50", "--data.corpus", "big.bin"],
     "--model.seq-len 100000"),
    # the corpus
    (["--data.corpus", "nowhere"], "nowhere"),
    (["--data.corpus", "nomatch/*.txt"], "nomatch/*.txt"),
    (["--data.corpus", "empty"], "empty"),
    (["--data.corpus", "noise.txt"], "is binary"),
    (["--data.corpus", "tokens.bin", "--data.mode", "packed"], "--data.mode packed"),
    (["--data.corpus", "small.txt"], "small.txt"),
    (["--data.corpus", "matrix.npy"], "matrix.npy"),
    (["--data.corpus", "tokens.bin", "--data.tokenizer", "bpe:300"], "already tokenized"),
    (["--data.tokenizer", "nosuch.json"], "nosuch.json"),
    (["--data.tokenizer", "bpe:abc"], "bpe:abc"),
    # directories and resumes
    (["--out-dir", ""], "--out-dir is empty"),
    (["--out-dir", "afile"], "--out-dir afile"),
    (["--out-dir", "afile/run"], "--out-dir afile/run"),
    (["--checkpoint-dir", "afile"], "--checkpoint-dir afile"),
    (["--out-dir", "taken"], "--out-dir taken holds another run"),
    (["--checkpoint-dir", "ckpts"], "--checkpoint-dir ckpts holds another run's checkpoints"),
    (["--resume", "--out-dir", "afile"], "--out-dir afile is a file"),
    (["--resume", "--out-dir", "taken"], "is not a run's config.json"),
    (["--strict"], "--strict applies to --resume only"),
    (["--allow-fresh"], "--allow-fresh applies to --resume only"),
    (["--allow-new-corpus"], "--allow-new-corpus applies to --resume only"),
    # parallelism and imports
    (["--mesh", "data=8"], "--batch-size that is a multiple of 8"),
    (["--mesh", "data=16"], "--mesh data=16"),
    (["--mesh", "bogus"], "--mesh"),
    (["--strategy", "nosuch"], "--strategy"),
    (["--context", "ring"], "--mesh context=2"),
    (["--import", "eqgpt_no_such_module"], "eqgpt_no_such_module"),
]

WRONG_SAMPLE = [
    (["--top-k", "0"], "--top-k"),
    (["--run-dir", "nowhere"], "--run-dir nowhere"),
    (["--hf", "nowhere"], "--hf nowhere"),
    (["--prompt-text", "x"], "did you mean --prompt"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--temperature", "hot"], "--temperature"),
]

WRONG_INTEROP = [
    ([], "command"),
    (["bogus"], "bogus"),
    (["export"], "--run"),
    (["export", "--run", "nowhere", "--to", "out"], "nowhere"),
    (["export", "--run", "nowhere", "--to", "out", "--step", "x"], "--step"),
    (["import", "--from", "nowhere", "--to", "out"], "nowhere"),
]


@pytest.fixture(scope="module")
def wrong_inputs_dir(tmp_path_factory):
    """A working directory with the files the wrong inputs name (and a tiny corpus for the others)."""
    import numpy as np

    from recipe_runs import write_documents

    root = tmp_path_factory.mktemp("wrong")
    write_documents(root / "docs")
    (root / "empty").mkdir()
    (root / "afile").write_text("not a directory")
    (root / "noise.txt").write_bytes(bytes(range(256)) * 64)
    (root / "small.txt").write_text("tiny\n")
    (root / "taken").mkdir()
    (root / "taken" / "config.json").write_text("{}")
    (root / "ckpts" / "5").mkdir(parents=True)
    np.random.default_rng(0).integers(0, 250, 5000).astype(np.uint16).tofile(root / "tokens.bin")
    np.random.default_rng(0).integers(0, 250, 300_000).astype(np.uint16).tofile(root / "big.bin")
    np.save(root / "matrix.npy", np.zeros((4, 4), np.int32))
    (root / "odd.bin").write_bytes(b"\1" * 20001)
    return root


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused_in_one_line(run, args, root, capsys) -> str:
    """`run(args)` in this process: `refused`, and nothing written under `root`."""
    before = listing(root)
    with pytest.raises(SystemExit) as e:
        run(args)
    err = refused(e.value.code, capsys.readouterr().err, args)
    assert listing(root) == before, args  # no file, no directory
    return err


@pytest.mark.parametrize("args, words", WRONG_TRAIN, ids=[" ".join(a) or "''" for a, _ in WRONG_TRAIN])
def test_wrong_train_inputs(args, words, wrong_inputs_dir, monkeypatch, capsys, tmp_path):
    import eqgpt.cli.train as train

    monkeypatch.chdir(wrong_inputs_dir)
    monkeypatch.setenv("EQGPT_CACHE", str(tmp_path / "cache"))  # token caches go outside the directory checked
    monkeypatch.setattr(train, "restart_with_malloc_tunables", lambda: None)
    base = ["--model.num-layers", "1", "--model.num-heads", "2", "--model.embed-dim", "16", "--model.seq-len", "16",
            "--batch-size", "4", "--steps", "1", "--eval-windows", "0", "--sample-tokens", "0", "--no-progress",
            "--no-compile-cache", "--data.corpus", "docs", "--out-dir", "runs/new"]
    if "--model.embed-dim" in args or "--model.num-heads" in args:
        base = base[6:]  # the case sets the shape itself
    err = refused_in_one_line(train.run, [*base, *args], wrong_inputs_dir, capsys)
    assert words in err, err


@pytest.mark.parametrize("args, words", WRONG_SAMPLE, ids=[" ".join(a) for a, _ in WRONG_SAMPLE])
def test_wrong_sample_inputs(args, words, wrong_inputs_dir, monkeypatch, capsys):
    from eqgpt.cli.sample import run

    monkeypatch.chdir(wrong_inputs_dir)
    assert words in refused_in_one_line(run, args, wrong_inputs_dir, capsys)


@pytest.mark.parametrize("args, words", WRONG_INTEROP, ids=[" ".join(a) or "''" for a, _ in WRONG_INTEROP])
def test_wrong_interop_inputs(args, words, wrong_inputs_dir, monkeypatch, capsys):
    from eqgpt.interop.__main__ import main

    monkeypatch.chdir(wrong_inputs_dir)
    assert words in refused_in_one_line(lambda a: sys.exit(main(a)), args, wrong_inputs_dir, capsys)


def test_the_table_covers_every_flag_family():
    assert len(WRONG_TRAIN) + len(WRONG_SAMPLE) + len(WRONG_INTEROP) >= 100
    flags = {a.split("=")[0] for args, _ in WRONG_TRAIN for a in args if a.startswith("--")}
    for family in ("--model.", "--data.", "--optim.", "--mesh", "--strategy", "--out-dir", "--checkpoint-",
                   "--resume", "--import", "--profile-steps", "--precision", "--max-skipped"):
        assert any(f.startswith(family) for f in flags), family
