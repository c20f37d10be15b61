"""Every `recipes/train_gpt.py` command of docs/parallelism/*.md runs to its end, trimmed to a tiny
model and two steps (its layers scanned): it trains, validates, samples and writes its plot, samples
and summary. The commands whose compositions test_strategies also trains like one device (its
DOCUMENTED) run to their end there instead."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from recipe_runs import check_ran_to_the_end, load_recipe, page_commands, write_documents
from test_strategies import DOCUMENTED

# Appended, so they win over the command's own values: a tiny model, two steps, a few samples.
TRIM = ["--steps", "2", "--batch-size", "16", "--model.embed-dim", "32", "--model.seq-len", "32",
        "--eval-windows", "2", "--eval-every", "2", "--log-every", "1", "--sample-tokens", "4",
        "--sample-prompts", "def ", "--no-progress", "--peak-flops", "1e12", "--no-compile-cache",
        "--model.scan-layers"]  # compile-bound: layers scanned (recipe_runs.TINY says why)


def trimmed(command: str) -> list[str]:
    """The command's flags, then TRIM's (a tiny model, two steps), then one layer unless it pipelines."""
    layers = [] if "--pipeline" in command else ["--model.num-layers", "1"]  # stages need their layers
    return [*shlex.split(command), *TRIM, *layers]


def commands() -> list:
    """One test per distinct trimmed run: commands that differ only in what TRIM overrides (such as
    --model.seq-len 8192 beside the same command without it) run once, under the first one's name;
    none for those test_strategies runs to their end (its DOCUMENTED: trained like one device as well)."""
    recipe, runs = load_recipe(), {}

    def key(command: str) -> str:
        return json.dumps(dataclasses.asdict(recipe.parse_flags(trimmed(command))), sort_keys=True, default=str)

    runs.update((key(command), None) for command in DOCUMENTED.values())
    for command, page in page_commands().items():
        runs.setdefault(key(command), (command, page))
    return [pytest.param(command, id=f"{page}: {command}") for command, page in filter(None, runs.values())]


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
    recipe.main(recipe.parse_flags(args))
    check_ran_to_the_end(out / "run", capsys.readouterr().out, steps=2)
