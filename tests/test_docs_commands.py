"""Every `recipes/train_gpt.py` command of docs/parallelism/*.md runs to its end, trimmed to a tiny
model and two steps (its layers scanned): it trains, validates, samples and writes its plot, samples
and summary."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from recipe_runs import load_recipe, write_documents

PAGES = Path(__file__).resolve().parents[1] / "docs" / "parallelism"
BLOCK = re.compile(r"^```(?:bash|text)\n(.*?)^```", re.S | re.M)
# Appended, so they win over the command's own values: a tiny model, two steps, a few samples.
TRIM = ["--steps", "2", "--batch-size", "16", "--model.embed-dim", "32", "--model.seq-len", "32",
        "--eval-windows", "2", "--eval-every", "2", "--log-every", "1", "--sample-tokens", "4",
        "--sample-prompts", "def ", "--no-progress", "--peak-flops", "1e12", "--no-compile-cache",
        "--model.scan-layers"]  # compile-bound: layers scanned (recipe_runs.TINY says why)


def page_commands() -> dict[str, str]:
    """Each page's train_gpt.py command lines (shell variables such as $T and $C expanded,
    continuation lines joined, `--cpu-devices` dropped: the suite has 8 CPU devices), once each,
    with the page that holds each."""
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


def trimmed(command: str) -> list[str]:
    """The command's flags, then TRIM's (a tiny model, two steps), then one layer unless it pipelines."""
    layers = [] if "--pipeline" in command else ["--model.num-layers", "1"]  # stages need their layers
    return [*shlex.split(command), *TRIM, *layers]


def commands() -> list:
    """One test per distinct trimmed run: commands that differ only in what TRIM overrides (such as
    --model.seq-len 8192 beside the same command without it) run once, under the first one's name."""
    recipe, runs = load_recipe(), {}
    for command, page in page_commands().items():
        cfg = dataclasses.asdict(recipe.parse_flags(trimmed(command)))
        runs.setdefault(json.dumps(cfg, sort_keys=True, default=str), (command, page))
    return [pytest.param(command, id=f"{page}: {command}") for command, page in runs.values()]


def test_the_pages_hold_the_commands_users_copy():
    got = list(page_commands())
    assert len(got) >= 15, got
    assert "--model.preset moe-nano --mesh expert=4,data=2" in got  # sampling crashed there once


@pytest.mark.parametrize("command", commands())
def test_docs_command_runs_to_the_end(command, tmp_path_factory, capsys):
    root = tmp_path_factory.getbasetemp()
    docs = root / "docs-commands-corpus"
    if not docs.exists():
        write_documents(docs, n=60)
    out = tmp_path_factory.mktemp("run")
    recipe = load_recipe()
    args = [*trimmed(command), "--data.corpus", str(docs), "--data.cache-dir", str(root / "cache"),
            "--out-dir", str(out / "run")]
    summary = recipe.main(recipe.parse_flags(args))
    assert summary["steps"] == 2 and not summary["interrupted"]
    assert len(summary["samples"]) == 1 and summary["samples"][0].startswith("def ")
    assert (out / "run" / "samples.txt").read_text().count("--- sample") == 1
    assert json.loads((out / "run" / "summary.json").read_text())["val_loss"] is not None
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "run" / "loss.png").stat().st_size > 0
    assert "done:" in capsys.readouterr().out
