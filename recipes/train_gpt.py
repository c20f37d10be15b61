"""Train a GPT: `eqgpt-train` (`eqgpt.cli.train`), kept here as a script. See `--help`.

    .venv/bin/python recipes/train_gpt.py
    .venv/bin/python recipes/train_gpt.py --steps 50 --data.corpus 'notes/**/*.md'
"""

if __name__ == "__main__":  # before the heavy imports, which a restart would repeat
    from eqgpt.launch import restart_with_malloc_tunables

    restart_with_malloc_tunables()

from eqgpt.cli.train import *  # noqa: E402, F403  (the recipe's names: TrainConfig, main, parse_flags, ...)
from eqgpt.cli.train import run  # noqa: E402

if __name__ == "__main__":
    run()
