"""Train a GPT: `eqgpt-train` (`eqgpt.cli.train`), kept here as a script. See `--help`.

    .venv/bin/python recipes/train_gpt.py
    .venv/bin/python recipes/train_gpt.py --steps 50 --data.corpus 'notes/**/*.md'
"""

if __name__ == "__main__":  # before the heavy imports, which a restart would repeat
    from eqgpt.cli.entry import quiet_native_logs
    from eqgpt.launch import restart_with_malloc_tunables

    restart_with_malloc_tunables()
    quiet_native_logs()

from eqgpt.cli.train import (  # noqa: E402  (the recipe's names, as eqgpt.cli.train.__all__ lists them)
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    check_run_flags,
    main,
    parse_flags,
    run,
    strategy_of,
    use_compile_cache,
)

__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "TrainConfig", "check_run_flags", "main", "parse_flags", "run",
           "strategy_of", "use_compile_cache"]

if __name__ == "__main__":
    run()
