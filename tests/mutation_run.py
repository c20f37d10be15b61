"""Tool-driven mutation testing of one module with mutmut 3: `nox -s mutation -- MODULE`.

MODULE is a path under `src/eqgpt/` (`nn/mask.py`). The tests that cover it are listed in
`pyproject.toml` (`[tool.eqgpt.mutation.modules]`); mutmut's own settings are `[tool.mutmut]`.
Each module runs in a work folder of its own, `.mutation/<module>/` (ignored by git): a copy
of `src/` and `tests/` and a `pyproject.toml` whose `[tool.mutmut]` mutates only MODULE and
selects only its tests. mutmut then records which of those tests reach each mutated function
and runs only those on that function's mutants. Results persist there, so a run interrupted
or repeated goes on where it stopped (`--fresh` starts over).

At the end it prints the module's row of the table in `docs/testing.md` (generated, killed,
equivalent, survived, other) and every survivor's diff. A survivor either gets a test that
kills it, or a line in `tests/mutation_equivalents.txt`:

    <mutant name> | <the mutated line, stripped> | <why no behaviour can tell it apart>

The mutated line is checked against the mutant's diff, so an entry goes stale (and is reported)
when the code under it changes.

    python tests/mutation_run.py nn/mask.py [--max-children 2] [--fresh] [--report] [--survivors]

`--survivors` tests only the survivors (and the mutants no test reached) again, with the tests
as they are now (after adding one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.txt"
# mutmut's exit codes of a mutant's test run (mutmut.stats.status_by_exit_code)
KILLED, SURVIVED, NO_TESTS = {1, 3}, {0}, {5, 33}
MUTMUT = str(Path(sys.executable).with_name("mutmut"))  # the script: `python -m mutmut` re-imports itself


def settings() -> tuple[dict, dict[str, list[str]]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["mutmut"], data["tool"]["eqgpt"]["mutation"]["modules"]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


def prepare(module: str, work: Path, fresh: bool) -> None:
    """The work folder: fresh copies of src/, tests/ and recipes/ (the recipe tests load a script from
    it), and the module's own [tool.mutmut]."""
    base, modules = settings()
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for d in ("src", "tests", "recipes"):
        shutil.rmtree(work / d, ignore_errors=True)
        shutil.copytree(ROOT / d, work / d, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
    mine = {**base, "only_mutate": [f"src/eqgpt/{module}"], "pytest_add_cli_args_test_selection": modules[module]}
    text = (ROOT / "pyproject.toml").read_text()  # pytest's settings stay; [tool.mutmut] is this module's
    head, rest = text.split("\n[tool.mutmut]\n", 1)
    tail = rest.split("\n[tool.eqgpt.mutation.modules]\n", 1)[1].split("\n[", 1)
    (work / "pyproject.toml").write_text(
        head + ("\n[" + tail[1] if len(tail) > 1 else "") + "\n[tool.mutmut]\n"
        + "".join(f"{k} = {toml_value(v)}\n" for k, v in mine.items()))


def equivalents() -> dict[str, tuple[str, str]]:
    """`{mutant: (mutated line, reason)}` from tests/mutation_equivalents.txt."""
    out = {}
    for line in EQUIVALENTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, code, reason = (part.strip() for part in line.split(" | ", 2))
            out[name] = (code, reason)
    return out


def diff(work: Path, name: str) -> str:
    return subprocess.run([MUTMUT, "show", name], cwd=work, capture_output=True,
                          text=True).stdout


def exit_codes(work: Path) -> dict[str, int | None]:
    """Every mutant of the work folder and the exit code of its tests (None: not run yet)."""
    codes: dict[str, int | None] = {}
    for meta in (work / "mutants").rglob("*.meta"):
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def report(module: str, work: Path) -> dict:
    """Count the module's mutants by outcome and print the survivors not on the equivalents list."""
    codes = exit_codes(work)
    known = equivalents()
    counts = {"generated": len(codes), "killed": 0, "equivalent": 0, "survived": 0, "other": 0}
    stale, survivors, other = [], [], []
    for name, code in sorted(codes.items()):
        if code in KILLED:
            counts["killed"] += 1
            if name in known:
                stale.append(f"{name}: on the equivalents list, but a test kills it")
        elif code in SURVIVED and name in known:
            if known[name][0] not in diff(work, name):
                stale.append(f"{name}: its diff no longer holds `{known[name][0]}`")
            counts["equivalent"] += 1
        elif code in SURVIVED:
            counts["survived"] += 1
            survivors.append(name)
        else:
            counts["other"] += 1
            other.append(f"{name}: exit code {code} ({'no tests reach it' if code in NO_TESTS else 'see mutmut'})")
    for name in survivors:
        print(f"--- survived: {name}\n{diff(work, name)}")
    for line in stale + other:
        print("!", line)
    score = counts["killed"] / max(counts["generated"] - counts["equivalent"], 1)
    print("| module | generated | killed | equivalent | survived | other | killed / (generated - equivalent) |")
    cells = " | ".join(str(counts[k]) for k in ("generated", "killed", "equivalent", "survived", "other"))
    print(f"| `{module}` | {cells} | {100 * score:.1f}% |")
    return counts


def main() -> int:
    _, modules = settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module", choices=sorted(modules), help="a module under src/eqgpt/")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results of this module")
    parser.add_argument("--report", action="store_true", help="only print the table row and the survivors")
    parser.add_argument("--survivors", action="store_true",
                        help="test survivors and mutants no test reached again, with the tests as they are now")
    args = parser.parse_args()
    work = ROOT / ".mutation" / args.module.replace("/", "_").removesuffix(".py")
    if not args.report:
        prepare(args.module, work, args.fresh)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
        names = [n for n, c in exit_codes(work).items() if c in SURVIVED | NO_TESTS] if args.survivors else []
        subprocess.run([MUTMUT, "run", "--max-children", str(args.max_children), *names],
                       cwd=work, env=env, check=True)
    report(args.module, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
