"""The `eqgpt-train` console script, light to import: it restarts with the malloc settings
(`eqgpt.launch.restart_with_malloc_tunables`) before importing JAX and the trainer, so a
restart does not import them twice."""

from __future__ import annotations

import sys

from eqgpt.launch import restart_with_malloc_tunables


def train() -> None:
    """`eqgpt.cli.train.run`, after the restart; with --compile-only, `eqgpt.cli.plan.run` (eqgpt-plan's
    report for --slice: nothing trains)."""
    restart_with_malloc_tunables()
    if any(a.split("=")[0] == "--compile-only" for a in sys.argv[1:]):
        from eqgpt.cli.plan import run as plan

        plan(from_trainer=True)
        return
    from eqgpt.cli.train import run

    run()
