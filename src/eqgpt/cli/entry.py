"""The `eqgpt-train` console script, light to import: it restarts with the malloc settings
(`eqgpt.launch.restart_with_malloc_tunables`) before importing JAX and the trainer, so a
restart does not import them twice."""

from __future__ import annotations

from eqgpt.launch import restart_with_malloc_tunables


def train() -> None:
    """`eqgpt.cli.train.run`, after the restart."""
    restart_with_malloc_tunables()
    from eqgpt.cli.train import run

    run()
