"""Every ```python block in docs/ runs, each in a fresh namespace on 8 CPU devices, and every
figure a page states as its output is what the snippet prints.

A page states a snippet's output in a ```text block after it, marked by the line
`<!-- prints -->` (or `<!-- prints rtol=0.3 -->` for figures that move with XLA's version,
such as compiled memory) right above the block. Each stated line must appear, in order,
among the lines the snippet printed: the words exactly (runs of spaces are one), every
number within `rtol` plus half a unit of its last stated digit. So a stale figure fails here.
"""

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
STATED = re.compile(r"^<!-- prints(?: rtol=([0-9.]+))? -->\n```text\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*prints\b")  # any marker, well-formed or not
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def snippets():
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        blocks = list(BLOCK.finditer(text))
        for i, block in enumerate(blocks):
            end = blocks[i + 1].start() if i + 1 < len(blocks) else len(text)
            stated = [(float(m.group(1) or 0), m.group(2)) for m in STATED.finditer(text, block.end(), end)]
            yield pytest.param(block.group(1), stated, id=f"{page.relative_to(DOCS)}#{i}")


def _split(line: str) -> tuple[str, list[str]]:
    """A line's words (numbers replaced by '#', spaces collapsed) and its numbers."""
    return " ".join(NUMBER.sub("#", line).split()), NUMBER.findall(line)


def _close(stated: str, printed: str, rtol: float) -> bool:
    want, got = float(stated.replace(",", "")), float(printed.replace(",", ""))
    digits = len(stated.split(".")[1].split("e")[0]) if "." in stated else 0
    return abs(got - want) <= rtol * abs(want) + 0.5 * 10.0**-digits * (1 + 1e-9)


def check_stated_output(stated: str, printed: str, rtol: float = 0.0) -> None:
    """**Raises** AssertionError unless each non-empty line of `stated` matches a line of
    `printed` (in order; see the module docstring)."""
    lines = iter([_split(line) for line in printed.splitlines() if line.strip()])
    for want_line in filter(str.strip, stated.splitlines()):
        words, numbers = _split(want_line)
        for got_words, got_numbers in lines:
            if got_words == words and len(got_numbers) == len(numbers):
                bad = [(w, g) for w, g in zip(numbers, got_numbers, strict=True) if not _close(w, g, rtol)]
                assert not bad, f"stated {want_line!r}: printed {bad} (stated, printed) outside rtol {rtol}"
                break
        else:
            raise AssertionError(f"stated {want_line!r}, but the snippet printed no such line "
                                 f"(after the lines matched before it):\n{printed}")


@pytest.mark.parametrize(("code", "stated"), list(snippets()))
def test_snippet_runs(code, stated, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc snippet>", "exec"), {"__name__": "__doc_snippet__"})
    printed = capsys.readouterr().out
    for rtol, block in stated:
        check_stated_output(block, printed, rtol)


def test_a_stated_figure_edited_away_from_the_output_fails():
    printed = "remat=none: estimate 24.0 MiB\nremat=full: estimate 3.7 MiB\n0.80 GFLOP per token\n"
    check_stated_output("remat=none: estimate 24.0 MiB\nremat=full: estimate  3.7 MiB", printed)
    check_stated_output("0.8 GFLOP per token", printed)  # 0.80 is within half a unit of 0.8
    for stale in ("remat=none: estimate 23.4 MiB", "remat=full: estimate 3.6 MiB", "0.81 GFLOP per token",
                  "remat=none: temporaries 24.0 MiB", "0.80 GFLOP per token\nremat=none: estimate 24.0 MiB"):
        with pytest.raises(AssertionError):
            check_stated_output(stale, printed)
    check_stated_output("remat=none: estimate 20.0 MiB", printed, rtol=0.25)  # a stated tolerance
    with pytest.raises(AssertionError):
        check_stated_output("remat=none: estimate 18.0 MiB", printed, rtol=0.25)


def test_every_stated_output_follows_a_snippet():
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        first = BLOCK.search(text)
        for m in STATED.finditer(text):
            assert first and m.start() > first.end(), f"{page}: a <!-- prints --> block before any python snippet"


def test_every_prints_marker_is_checked():
    """As many `<!-- prints -->` markers as checked blocks: a marker `STATED` misses (a typo, a
    blank line before its block) would otherwise state a figure nothing checks."""
    markers = sum(len(MARKER.findall(page.read_text())) for page in DOCS.rglob("*.md"))
    checked = sum(len(param.values[1]) for param in snippets())
    assert markers == checked > 0
    unchecked = "<!-- prints -->\n\n```text\n1.0\n```\n"
    assert MARKER.search(unchecked) and not STATED.search(unchecked)
