"""Run the mutation catalogue: each bug applied to a copy of `src/`, its tests run against it.

    python tests/mutants/run.py                 # every mutation, one at a time
    python tests/mutants/run.py --only a,b      # some of them
    python tests/mutants/run.py --baseline      # first, each selection on the unmutated copy
    python tests/mutants/run.py --list          # the catalogue

For each mutation: copy `src/` to a temporary directory, replace the snippet (which must
occur exactly once), and run its tests with `PYTHONPATH` at the copy (ahead of the
editable install, which is checked once at the start). A mutation is caught when pytest
reports failing tests (exit code 1); errors, timeouts and passes are not. The table gives
the `[margin Nx]` the failing test printed (its worst error / tolerance) where it prints one,
and the exception it raised (AssertionError: a comparison failed; another: the bug crashed).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from catalogue import CATALOGUE, Mutation

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def mutated_copy(mutation: Mutation | None, into: Path) -> Path:
    """`src/` copied under `into`, with `mutation` applied; **returns** the copy's `src`."""
    src = into / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    if mutation is not None:
        path = src / "eqgpt" / mutation.file
        text = path.read_text()
        count = text.count(mutation.original)
        if count != 1:
            raise ValueError(f"{mutation.name}: the snippet occurs {count} times in {mutation.file} (stale catalogue?)")
        path.write_text(text.replace(mutation.original, mutation.replacement))
    return src


def environment(src: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
    return env


def check_shadowing() -> None:
    """The copy, not the editable install, is what `import eqgpt` finds under `environment`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = mutated_copy(None, Path(tmp))
        out = subprocess.run([sys.executable, "-c", "import eqgpt; print(eqgpt.__file__)"], env=environment(src),
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
        if not out.startswith(str(src)):
            raise SystemExit(f"import eqgpt found {out}, not the mutated copy under {src}")


def run_tests(mutation: Mutation, src: Path, timeout: float) -> tuple[str, float | None, str, str, float]:
    """**Returns** (outcome, smallest printed margin, first failing test, its exception, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-n0", "-x", "-q", "-p", "no:cacheprovider", *shlex.split(mutation.tests)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=environment(src), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", None, "", "", time.monotonic() - start
    seconds = time.monotonic() - start
    text = proc.stdout + proc.stderr
    outcome = {0: "missed", 1: "caught"}.get(proc.returncode, f"error (rc {proc.returncode})")
    if proc.returncode == 5:
        outcome = "no tests selected"
    margins = [float(m) for m in re.findall(r"\[margin ([0-9.e+-]+)x\]", text)]
    failed = re.findall(r"^FAILED (.+?)(?: - .*)?$", text, flags=re.M)
    raised = re.search(r"^E\s+(?:\w+\.)*(\w+(?:Error|Exception|Exit)|Failed|assert)\b", text, flags=re.M)
    kind = "" if raised is None else "AssertionError" if raised.group(1) == "assert" else raised.group(1)
    return outcome, min(margins) if margins else None, failed[0] if failed else "", kind, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated mutation names")
    parser.add_argument("--baseline", action="store_true", help="run each selection unmutated first")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutation")
    args = parser.parse_args()
    chosen = [m for m in CATALOGUE if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name:40} {m.file:32} {m.tests}")
        return 0
    check_shadowing()
    if args.baseline:
        for tests in sorted({m.tests for m in chosen}):
            with tempfile.TemporaryDirectory() as tmp:
                probe = Mutation("baseline", "", "", "", tests)
                outcome, _, failed, _, seconds = run_tests(probe, mutated_copy(None, Path(tmp)), args.timeout)
                print(f"baseline {tests}: {'passes' if outcome == 'missed' else outcome} {failed} ({seconds:.0f} s)",
                      flush=True)
    rows, total = [], time.monotonic()
    print("| mutation | file | tests | result | margin | first failing test | raised | s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for m in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            outcome, margin, failed, raised, seconds = run_tests(m, mutated_copy(m, Path(tmp)), args.timeout)
        rows.append(outcome)
        shown = "" if margin is None else f"{margin:.3g}x"
        test = failed.split("::", 1)[-1] if failed else ""
        print(f"| {m.name} | {m.file} | `{m.tests}` | {outcome} | {shown} | {test} | {raised} | {seconds:.0f} |",
              flush=True)
    caught = rows.count("caught")
    print(f"\n{caught} of {len(rows)} caught in {time.monotonic() - total:.0f} s")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
