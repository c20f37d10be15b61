"""One trainer for every parallelism, run the way a user runs it: `recipes/train_gpt.py` flags.

Each composition trains a tiny model for a few steps through the recipe's own
command line (its `main`, in this process, on the suite's 8 simulated CPU devices;
the script as a fresh process is test_compile_once's and test_console's) and must
match the single-device losses. The compositions that docs/parallelism/index.md and
pipeline.md show run as those pages' commands, and also run to their end (validation,
samples, plot, summary: test_docs_commands' claim for those commands). Checkpoints
written under one strategy restore under others and continue exactly like the
uninterrupted run. Bad combinations fail with a `ValueError` before anything compiles.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tyro
from filelock import FileLock

from eqgpt.parallel.flags import tyro_registry
from recipe_runs import (
    RECIPES,
    TO_THE_END,
    check_ran_to_the_end,
    load_recipe,
    page_commands,
    run_dir,
    shared_dir,
)

# A tiny model every mesh below can split: 4 layers (2 stages x 2 chunks), 4 heads
# (tensor=4), 32 positions (zigzag over context=2, SP over tensor=4), batch 16
# (2 data-parallel devices x 4 microbatches x 2 rows). A constant learning rate, so
# steps 4..6 resumed from a step-3 checkpoint continue any run of 5 or 6 steps. Layers scanned, as
# in every compile-bound recipe run of the suite (`recipe_runs.TINY`).
MODEL = ["--model.num-layers", "4", "--model.num-heads", "4", "--model.embed-dim", "32", "--model.seq-len", "32",
         "--model.scan-layers"]
RUN = ["--peak-flops", "1e12", "--batch-size", "16", "--log-every", "1", "--eval-windows", "0", "--sample-tokens", "0",
       "--no-progress", "--optim.warmup-steps", "0", "--optim.min-lr-ratio", "1.0", "--optim.lr", "3e-3"]


def documented(command: str) -> list[str]:
    """The flags of `command`, a command a docs/parallelism page shows."""
    assert command in page_commands(), f"no docs/parallelism page shows {command!r} any more"
    return shlex.split(command)


# docs/parallelism commands run here (with MODEL and RUN) instead of in test_docs_commands.
DOCUMENTED = {
    "pipeline=2,data=2,tensor=2 1f1b":
        "--mesh pipeline=2,data=2,tensor=2 --strategy dp+tp --pipeline 1f1b --microbatches 8",
    "pipeline=2,fsdp=2,tensor=2 interleaved":
        "--mesh pipeline=2,fsdp=2,tensor=2 --strategy fsdp+tp --pipeline interleaved --virtual-stages 2",
    "context=2,fsdp=2,tensor=2 ring": "--mesh context=2,fsdp=2,tensor=2 --strategy fsdp+tp --context ring",
    "pipeline=2,context=2,tensor=2":
        "--mesh pipeline=2,context=2,tensor=2 --strategy tp --pipeline 1f1b --context ring",
    "manual data=2,tensor=4 sp": "--mesh data=2,tensor=4 --strategy dp+sp --manual",
    # Zero-bubble ZB-H1: the backward split into input (B) and weight (W) gradients.
    "pipeline=4,data=2 zb1": "--mesh pipeline=4,data=2 --pipeline zb1 --microbatches 8",
}
# Added to a documented command: the 1f1b pipeline runs its layers unevenly (3 on the first stage, 1 beside
# the head; the docs command's even split is the same schedule with other stage sizes).
UNEVEN = {"pipeline=2,data=2,tensor=2 1f1b": ["--pipeline-layers", "3,1"]}
STRATEGIES = {
    "single": [],
    "fsdp+tp": ["--mesh", "fsdp=4,tensor=2", "--strategy", "fsdp+tp"],
    **{name: [*documented(command), *UNEVEN.get(name, [])] for name, command in DOCUMENTED.items()},
    "pipeline=2,fsdp=2,tensor=2 zb1": ["--mesh", "pipeline=2,fsdp=2,tensor=2", "--strategy", "fsdp+tp",
                                       "--pipeline", "zb1", "--microbatches", "4"],
    # Collective matmul and gradient buckets (the manual part's settings).
    "manual data=2,tensor=4 sp cm+buckets": ["--mesh", "data=2,tensor=4", "--strategy", "dp+sp", "--manual",
                                             "--collective-matmul", "--bucket-mb", "0.01"],
    "manual data=2,tensor=4 tp buckets": ["--mesh", "data=2,tensor=4", "--strategy", "dp+tp", "--manual",
                                          "--bucket-mb", "0.01"],
    "manual data=8 buckets": ["--mesh", "data=8", "--strategy", "dp", "--manual", "--bucket-mb", "0.01"],
}
# With the manual part's options on (the manual path without them: test_manual_tp, test_gradient_parity).
COMMUNICATION = ["manual data=2,tensor=4 sp cm+buckets", "manual data=2,tensor=4 tp buckets", "manual data=8 buckets"]
COMPOSED = [k for k in STRATEGIES if k not in ("single", "fsdp+tp", *COMMUNICATION)]
# Checkpoint portability: saved under each, restored under the next (the last under one device), so every
# strategy restores another's checkpoint, and one device restores that of ZB-H1 (split over pipeline stages).
PORTABLE = ["single", "fsdp+tp", "context=2,fsdp=2,tensor=2 ring", "pipeline=2,data=2,tensor=2 1f1b",
            "manual data=2,tensor=4 sp", "pipeline=4,data=2 zb1"]


RECIPE_PATH = RECIPES / "train_gpt.py"
RECIPE = load_recipe()  # the same script as a module: bad flags fail in this process, before any compile


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(6):
        (root / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x * {j}\n" for j in rng.integers(0, 9, 60)))
    cache = tmp_path_factory.mktemp("token-cache")  # outside the corpus: its files are not text to train on
    return ["--data.corpus", str(root), "--data.cache-dir", str(cache), "--data.val-percent", "20"]


def train(corpus: list[str], out: Path, strategy: str, *extra: str) -> list[tuple[float, float]]:
    """`recipes/train_gpt.py <flags>` through its `main` in this process; what it printed goes to
    `out/printed.txt`. **Returns** its logged `(loss, grad_norm)` per step."""
    args = [*MODEL, *RUN, *corpus, "--out-dir", str(out), *STRATEGIES[strategy], *extra]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        RECIPE.main(RECIPE.parse_flags(args))
    (out / "printed.txt").write_text(printed.getvalue())
    return logged(out)


def run(corpus: list[str], out: Path, strategy: str, *extra: str, cache: tuple | None = None) -> list[float]:
    """`python recipes/train_gpt.py <flags>` in a fresh process (test_overlap's runs: its XLA flags
    are set per process); with `cache` (`recipe_runs.subprocess_compile_cache`), the worker's own
    compilation cache. **Returns** its logged `(loss, grad_norm)` per step."""
    args = [*MODEL, *RUN, *corpus, "--out-dir", str(out), *STRATEGIES[strategy], *extra]
    env, cache_flags = cache or (os.environ, [])
    # XLA_FLAGS comes from conftest.py: every compile at XLA:CPU's backend optimisation level 0.
    env = {**env, "JAX_NUM_CPU_DEVICES": "8"}  # GLIBC_TUNABLES from conftest.py: glibc's defaults
    proc = subprocess.run([sys.executable, str(RECIPE_PATH), *args, *cache_flags], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"train_gpt.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return logged(out)


def logged(out: Path) -> list[tuple[float, float]]:
    """A run's logged `(loss, grad_norm)` per step (in `out/metrics.jsonl`)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # (loss, grad_norm) per step: a gradient scaled by a constant leaves AdamW's losses alike, not its norm.
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


_RUNS: dict[str, tuple[list[float], Path]] = {}


def trained(strategy: str, corpus, tmp_path_factory) -> tuple[list[float], Path]:
    """One run per strategy, checkpointed after step 3, made once for all xdist workers (the
    first to need it runs it, in a folder they share): 6 steps on one device (the reference
    every other run must reproduce), 5 under the others; a DOCUMENTED one also runs to its
    end (TO_THE_END). **Returns** (losses, out dir)."""
    if strategy not in _RUNS:
        root = shared_dir(tmp_path_factory, "strategies")
        root.mkdir(exist_ok=True)
        out = run_dir(root, strategy.replace(" ", "_"))
        with FileLock(str(out) + ".lock"):
            if not (out / "done").exists():
                shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
                steps = "6" if strategy == "single" else "5"
                train(corpus, out, strategy, "--steps", steps, "--checkpoint-every", "3",
                      *(TO_THE_END if strategy in DOCUMENTED else []))
                (out / "done").touch()
        _RUNS[strategy] = logged(out), out
    return _RUNS[strategy]


@pytest.mark.parametrize("strategy", COMPOSED)
def test_composed_strategies_train_like_one_device(strategy, corpus, tmp_path_factory):
    losses, out = trained(strategy, corpus, tmp_path_factory)
    np.testing.assert_allclose(losses, trained("single", corpus, tmp_path_factory)[0][:5], rtol=1e-5)
    if strategy in DOCUMENTED:
        check_ran_to_the_end(out, (out / "printed.txt").read_text(), steps=5)


@pytest.mark.parametrize("on", COMMUNICATION)
def test_collective_matmul_and_buckets_train_like_one_device(on, corpus, tmp_path_factory):
    losses, _ = trained(on, corpus, tmp_path_factory)
    np.testing.assert_allclose(losses, trained("single", corpus, tmp_path_factory)[0][:5], rtol=1e-5)


@pytest.mark.parametrize("saved", PORTABLE)
def test_checkpoints_restore_under_any_strategy(saved, corpus, tmp_path, tmp_path_factory):
    ref = trained("single", corpus, tmp_path_factory)[0]
    first, saved_dir = trained(saved, corpus, tmp_path_factory)
    np.testing.assert_allclose(first[:3], ref[:3], rtol=1e-5)
    target = PORTABLE[(PORTABLE.index(saved) + 1) % len(PORTABLE)]
    shutil.copytree(saved_dir / "checkpoints" / "3", tmp_path / "checkpoints" / "3")  # the step-3 checkpoint only
    resumed = train(corpus, tmp_path, target, "--steps", "6", "--resume")
    np.testing.assert_allclose(resumed, ref[3:], rtol=2e-5, err_msg=f"saved under {saved}, resumed under {target}")


@pytest.mark.parametrize("flags, match", [
    (["--mesh", "pipeline=2,data=4", "--strategy", "dp"], r"mesh axes \[.pipeline.\].*used by no part"),
    (["--mesh", "data=2,tensor=4", "--strategy", "dp"], r"\['tensor'\].*add 'tp' or 'sp'"),
    (["--mesh", "context=2,data=4", "--strategy", "dp"], r"\['context'\].*--context ring"),
    (["--mesh", "pipeline=8", "--strategy", "dp", "--pipeline", "1f1b", "--microbatches", "2"],
     r"num_layers=4 cannot be split into 8 stages"),
    (["--mesh", "data=2,tensor=4", "--strategy", "dp+tp", "--manual", "--context", "ring"], "manual path"),
    (["--pipeline", "1f1b"], "needs a mesh"),
    (["--mesh", "pipeline=4,data=2", "--strategy", "dp", "--pipeline", "zb1", "--microbatches", "2"],
     r"zb1 needs at least as many microbatches as pipeline stages \(got m=2 for p=4\); use --microbatches 4"),
    (["--mesh", "pipeline=2,data=4", "--strategy", "dp", "--pipeline", "1f1b", "--pipeline-layers", "3,3"],
     r"layers_per_stage=\(3, 3\) must give each of the 2 virtual stages .* 4 layers in all"),
    (["--mesh", "pipeline=2,data=4", "--strategy", "dp", "--pipeline", "1f1b", "--pipeline-layers", "three"],
     "--pipeline-layers 'three': use 'equal', 'auto'"),
    (["--mesh", "data=8", "--strategy", "dp", "--batch-size", "12"], "multiple of 8"),
    (["--mesh", "data=8", "--strategy", "dp", "--manual", "--bucket-mb", "0"], "bucket_mb must be positive"),
    (["--mesh", "data=8", "--strategy", "dp", "--bucket-mb", "1"], r"bucket_mb \(--bucket-mb\).*add --manual"),
    (["--mesh", "data=8", "--strategy", "dp", "--manual", "--collective-matmul"],
     r"collective_matmul \(--collective-matmul\).*no tensor axis"),
    (["--mesh", "data=2,tensor=4", "--strategy", "dp+tp", "--manual", "--collective-matmul"],
     r"collective_matmul \(--collective-matmul\) needs sequence parallelism"),
    (["--mesh", "data=2,tensor=4", "--strategy", "dp+sp", "--collective-matmul"], "add --manual"),
    (["--mesh", "data=2,tensor=4", "--strategy", "dp+sp", "--manual", "--collective-matmul", "--model.seq-len", "30"],
     r"collective_matmul \(--collective-matmul\).*seq_len 30 is not divisible by 4"),
])
def test_bad_strategies_fail_before_compiling(flags, match, corpus, tmp_path):
    args = [*MODEL, *RUN, *corpus, "--out-dir", str(tmp_path), "--steps", "1", *flags]
    with pytest.raises(ValueError, match=match):
        RECIPE.main(tyro.cli(RECIPE.TrainConfig, registry=tyro_registry(), args=args))
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing ran
