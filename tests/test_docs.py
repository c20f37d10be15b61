"""Every ```python block in docs/ runs, each in a fresh namespace on 8 CPU devices."""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets():
    for page in sorted(DOCS.rglob("*.md")):
        for i, code in enumerate(BLOCK.findall(page.read_text())):
            yield pytest.param(code, id=f"{page.relative_to(DOCS)}#{i}")


@pytest.mark.parametrize("code", list(snippets()))
def test_snippet_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc_snippet__"})
