"""Generate text from a trained run: `eqgpt-sample` (`eqgpt.cli.sample`), kept here as a script.

    .venv/bin/python recipes/sample.py --prompt "def parse(" --temperature 0.7   # the newest run (runs/latest)
    .venv/bin/python recipes/sample.py --hf out/hf --prompt "Hello"      # a Hugging Face GPT-2 / Llama directory
"""

from eqgpt.cli.sample import SampleConfig, check_flags, main, run

__all__ = ["SampleConfig", "check_flags", "main", "run"]

if __name__ == "__main__":
    run()
