"""Run `recipes/train_gpt.py` in this process on a tiny model (shared by the data and logging tests)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import tyro
from filelock import FileLock

from eqgpt.parallel.flags import tyro_registry

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PAGES = RECIPES.parent / "docs" / "parallelism"
BLOCK = re.compile(r"^```(?:bash|text)\n(.*?)^```", re.S | re.M)
# Layers scanned (`--model.scan-layers`), not unrolled as the recipe's default is for so shallow a model: the
# suite's runs are compile-bound, and a run with its layers scanned takes 12-42% less time
# (docs/measured/suite_times.md); the unrolled stack is proven equal to the scan in test_nn.
TINY = ["--model.num-layers", "2", "--model.num-heads", "2", "--model.embed-dim", "32", "--model.seq-len", "32",
        "--model.scan-layers",
        "--batch-size", "8", "--log-every", "1", "--eval-windows", "4", "--eval-every", "5", "--sample-tokens", "0",
        "--no-progress", "--peak-flops", "1e12", "--optim.warmup-steps", "0", "--optim.min-lr-ratio", "1.0",
        "--optim.lr", "3e-3"]


def page_commands() -> dict[str, str]:
    """Each docs/parallelism page's train_gpt.py command lines (shell variables such as $T and $C
    expanded, continuation lines joined, `--cpu-devices` dropped: the suite has 8 CPU devices), once
    each, with the page that holds each (test_docs_commands runs them; test_strategies some of them)."""
    found = {}
    for page in sorted(PAGES.glob("*.md")):
        for block in BLOCK.findall(page.read_text()):
            variables = {}
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip().removeprefix("$ ")
                if re.match(r"^\w+=", line):
                    variables.update((k, v.strip('"')) for k, v in re.findall(r"(\w+)=(\"[^\"]*\"|[^;\s]+)", line))
                    continue
                for name, value in variables.items():
                    line = line.replace("$" + name, value)
                if "recipes/train_gpt.py" in line:
                    args = shlex.split(line.split("recipes/train_gpt.py", 1)[1])
                    args = [a for i, a in enumerate(args) if "--cpu-devices" not in (a, args[i - 1] if i else "")]
                    found.setdefault(" ".join(args), page.name)
    return found


def console_script(name: str) -> list[str]:
    """The console script `name` (`eqgpt-train`, `eqgpt-sample`) beside this Python, else its module run with `-m`."""
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", f"eqgpt.cli.{name.removeprefix('eqgpt-')}"]


def load_recipe():
    """`recipes/train_gpt.py` as a module, loaded once per process: a second load would replace
    the `sys.modules` entry through which an earlier load's dataclasses resolve their annotations."""
    if "recipe_train_gpt_data" in sys.modules:
        return sys.modules["recipe_train_gpt_data"]
    spec = importlib.util.spec_from_file_location("recipe_train_gpt_data", RECIPES / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def write_documents(root: Path, n: int = 120, seed: int = 0) -> Path:
    """`n` small Python files of 10..80 bytes: documents shorter and longer than a 33-token row."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        body = "".join(f"x{j} = {j}\n" for j in rng.integers(0, 9, rng.integers(1, 12)))
        (root / f"d{i:03d}.py").write_text(body)
    return root


def run_recipe(recipe, args: list[str]) -> list[dict]:
    """Run with `args` (plus --out-dir in args); **returns** the rows of metrics.jsonl."""
    recipe.main(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=args))
    out = Path(args[args.index("--out-dir") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def shared_dir(tmp_path_factory, name: str) -> Path:
    """The path of a folder `name` shared by this session's xdist workers (their base
    directories' parent), so that what one worker made another can read."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


def shared_corpus(tmp_path_factory, name: str) -> Path:
    """A folder `name` holding a small document corpus (`docs/`), shared by the xdist workers
    (`shared_dir`), so that runs one worker made another can read."""
    root = shared_dir(tmp_path_factory, name)
    with FileLock(str(root) + ".lock"):
        if not (root / "docs").exists():
            write_documents(root / "docs")
    return root


def subprocess_compile_cache(tmp_path_factory) -> tuple[dict[str, str], list[str]]:
    """The environment and flags of a `train_gpt.py` subprocess with its own xdist worker's persistent
    compilation cache (in the worker's base directory): a program one of the worker's runs compiled
    (the same strategy resumed, a mesh's initialisation, the small programs every run has) is read
    back, not compiled again. One directory per worker, whose runs follow one another: workers
    never read an entry another is writing (see conftest.py). **Returns** (env, flags)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EQGPT_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    return env, ["--compile-cache-dir", str(tmp_path_factory.getbasetemp() / "xla-cache")]


def run_once(root: Path, name: str, args: list[str]) -> list[dict]:
    """`train_gpt.py` with `args` on `root`'s corpus into `root/name`, once for all workers;
    **returns** its logged training rows (those with a loss)."""
    out = run_dir(root, name)
    with FileLock(str(out) + ".lock"):
        if not (out / "done").exists():
            run_recipe(load_recipe(), [*args, "--data.corpus", str(root / "docs"), "--data.cache-dir",
                                       str(root / "cache"), "--eval-windows", "0", "--out-dir", str(out)])
            (out / "done").touch()
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def run_dir(root: Path, name: str) -> Path:
    """Where `run_once(root, name, ...)` writes (mesh names made path-safe)."""
    return root / name.replace(",", "_").replace("=", "")


def seed_checkpoint(root: Path, saved: str, name: str, step: int = 3) -> None:
    """Copy run `saved`'s step-`step` checkpoint (alone) into run `name`'s, once, for a
    `--resume` run there."""
    out = run_dir(root, name)
    with FileLock(str(out) + ".lock"):
        if not (out / "checkpoints").exists():
            shutil.copytree(run_dir(root, saved) / "checkpoints" / str(step), out / "checkpoints" / str(step))


# Flags with which a run also shows that it runs to its end: validates, samples from "def " (test_docs_commands).
TO_THE_END = ["--eval-windows", "2", "--eval-every", "2", "--sample-tokens", "4", "--sample-prompts", "def "]


def check_ran_to_the_end(out: Path, printed: str, steps: int) -> None:
    """The run in `out` (flags TO_THE_END, which printed `printed`) trained `steps` steps, validated,
    sampled once and wrote its plot, samples and summary."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and not summary["interrupted"]
    assert len(summary["samples"]) == 1 and summary["samples"][0].startswith("def ")
    assert (out / "samples.txt").read_text().count("--- sample") == 1
    assert summary["val_loss"] is not None
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").stat().st_size > 0
    assert "done:" in printed
