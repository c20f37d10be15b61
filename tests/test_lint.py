"""The code passes ruff with the project's configuration (pyproject.toml: E501 at 120 characters
among the rules), so a long line or an unsorted import fails the suite as it fails `nox -s lint`."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_passes():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "recipes", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
