"""The mutation catalogue (`tests/mutants/`) stays applicable: a refactor that moves a snippet
fails here, in the suite, instead of leaving `run.py` to refuse the stale entry later."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mutants"))
from catalogue import CATALOGUE  # noqa: E402


def test_names_are_unique_and_the_catalogue_is_large():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)) and len(names) >= 30


@pytest.mark.parametrize("mutation", CATALOGUE, ids=lambda m: m.name)
def test_each_mutation_applies_once_to_its_file_and_names_existing_tests(mutation):
    text = (ROOT / "src" / "eqgpt" / mutation.file).read_text()
    assert text.count(mutation.original) == 1, f"{mutation.name}: the snippet no longer occurs once in {mutation.file}"
    assert mutation.replacement != mutation.original
    files = [a.split("::")[0] for a in shlex.split(mutation.tests) if a.startswith("tests/")]
    assert files and all((ROOT / f).is_file() for f in files), mutation.tests
