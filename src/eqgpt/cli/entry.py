"""The `eqgpt-train` console script, light to import: it restarts with the malloc settings
(`eqgpt.launch.restart_with_malloc_tunables`) before importing JAX and the trainer, so a
restart does not import them twice."""

from __future__ import annotations

import os
import sys

from eqgpt.launch import restart_with_malloc_tunables


def quiet_native_logs(args: list[str] | None = None) -> None:
    """Keep XLA's C++ log lines (`W0000 ... Involuntary full rematerialization ...`) out of the terminal
    unless `--verbose` is among `args` (default: the command line); a `TF_CPP_MIN_LOG_LEVEL` the user set
    wins. Call it before JAX is imported."""
    if "--verbose" not in (sys.argv[1:] if args is None else args):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def train() -> None:
    """`eqgpt.cli.train.run`, after the restart; with --compile-only, `eqgpt.cli.plan.run` (eqgpt-plan's
    report for --slice: nothing trains)."""
    restart_with_malloc_tunables()
    quiet_native_logs()
    if any(a.split("=")[0] == "--compile-only" for a in sys.argv[1:]):
        from eqgpt.cli.plan import run as plan

        plan(from_trainer=True)
        return
    from eqgpt.cli.train import run

    run()
