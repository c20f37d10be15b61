"""Train a GPT: `eqgpt-train` (`eqgpt.cli.train`), kept here as a script. See `--help`.

    .venv/bin/python recipes/train_gpt.py
    .venv/bin/python recipes/train_gpt.py --steps 50 --data.corpus 'notes/**/*.md'
"""

from eqgpt.cli.train import *  # noqa: F403  (the recipe's names: TrainConfig, main, parse_flags, ...)
from eqgpt.cli.train import run

if __name__ == "__main__":
    run()
