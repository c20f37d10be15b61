"""Every parallel recipe runs, in this process, in a small configuration.

The strategy recipes (`dp`, `fsdp`, `tp`, `sp`, `custom_rules`) say they print the
same losses: the test runs each script as written (its own mesh, rules and
overrides) on a smaller model for fewer steps and checks that the losses agree.
`pipeline`, `context` and `manual_tp` run through their `main(Args)` with small
arguments and must match one device's first loss.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

import eqgpt
from eqgpt.profile.compiles import CompileLog

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SMALL = eqgpt.preset("nano", seq_len=32)  # big enough that norms and biases stay under 5% of the bytes
STEPS = 2


@pytest.fixture(scope="module")
def demo():
    """`recipes/_parallel_demo.py`, importable as the recipes import it (`from _parallel_demo import train`)."""
    sys.path.insert(0, str(RECIPES))
    try:
        import _parallel_demo

        yield _parallel_demo
    finally:
        sys.path.remove(str(RECIPES))


def run_script(name: str, demo, monkeypatch) -> list[float]:
    """Run `recipes/<name>.py` as `__main__`, with `train` shrunk to SMALL and STEPS; **returns** its losses."""
    real, seen = demo.train, []

    def small_train(strategy, *, config=None, steps=None, batch=demo.BATCH):
        seen.append(real(strategy, config=SMALL if config is None else config, steps=STEPS, batch=batch))
        return seen[-1]

    monkeypatch.setattr(demo, "train", small_train)
    runpy.run_path(str(RECIPES / f"{name}.py"), run_name="__main__")
    assert len(seen) == 1, name
    return seen[0]


def load_main(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_strategy_recipes_print_the_same_losses(demo, monkeypatch, capsys):
    losses = {name: run_script(name, demo, monkeypatch) for name in ("dp", "fsdp", "tp", "sp", "custom_rules")}
    out = capsys.readouterr().out
    assert "collectives per call" in out and "memory per device" in out
    for name, got in losses.items():
        np.testing.assert_allclose(got, losses["dp"], rtol=2e-5, err_msg=name)
    assert losses["dp"][-1] < losses["dp"][0]


@pytest.mark.parametrize("name, args", [
    ("pipeline", dict(mesh="pipeline=2,data=4", schedule="1f1b", microbatches=2, rows=1, steps=STEPS)),
    ("context", dict(mesh="context=4,data=2", seq_len=64, batch_size=2, steps=STEPS)),
    ("manual_tp", dict(mesh="data=2,tensor=4", sp=True, steps=STEPS)),
])
def test_recipe_main_matches_one_device(name, args, demo, capsys):
    recipe = load_main(name)
    losses = recipe.main(recipe.Args(**args))
    out = capsys.readouterr().out
    one_device = float(out.split("step 0 on one device: ")[1].split()[0])
    assert len(losses) == STEPS and np.isfinite(losses).all()
    np.testing.assert_allclose(losses[0], one_device, rtol=1e-4)


def test_train_gpt_estimate_flag_prints_estimate_next_to_compiled(tmp_path, capsys):
    from recipe_runs import TINY, load_recipe, run_recipe, write_documents

    corpus = write_documents(tmp_path / "docs")
    args = [*TINY, "--data.corpus", str(corpus), "--data.cache-dir", str(tmp_path / "cache"), "--steps", "2",
            "--eval-windows", "0", "--mesh", "fsdp=8", "--strategy", "fsdp", "--estimate", "--report",
            "--out-dir", str(tmp_path / "run")]
    with CompileLog() as log:
        run_recipe(load_recipe(), args)
    out = capsys.readouterr().out
    first, compared = out.index("estimate MiB"), out.index("compiled MiB")  # the estimate comes first
    assert first < compared and "ratio" in out[compared:]
    assert log.counts["step"] == 1, dict(log.counts)  # --report and --estimate read the step the run trains with


def test_docs_figures_are_drawn_from_the_code(tmp_path, monkeypatch):
    """`docs/gen_figures.py` draws the committed pictures from the schedule and layout tables."""
    spec = importlib.util.spec_from_file_location("gen_figures", RECIPES.parent / "docs" / "gen_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    monkeypatch.setattr(figures, "IMG", tmp_path)
    written = figures.main()
    assert [p.name for p in written] == ["pipeline_schedules.png", "context_layout.png"]
    assert all((RECIPES.parent / "docs" / "img" / p.name).is_file() and p.stat().st_size > 10_000 for p in written)
    work = figures.causal_blocks(16, 4, "zigzag")
    assert (work.sum(0) == work.sum(0)[0]).all()  # zigzag balances causal work
