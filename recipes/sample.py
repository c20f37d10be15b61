"""Generate text from a model trained by `recipes/train_gpt.py` (KV-cache decoding).

    .venv/bin/python recipes/sample.py --run-dir runs/nano --prompt "def parse(" --temperature 0.7
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import tyro

from eqgpt.data import ByteTokenizer
from eqgpt.sample import generate_text
from eqgpt.train import load_model


@dataclass
class SampleConfig:
    """Load a trained model and continue a prompt."""

    run_dir: Path = Path("runs/nano")
    """Output directory of a training run (holds model.eqx and model_config.json)."""
    prompt: str = "def "
    """Text to continue."""
    max_new_tokens: int = 200
    """New tokens per sample (prompt + new must fit the model's seq_len; longer is clipped)."""
    num_samples: int = 2
    """How many continuations."""
    temperature: float = 0.8
    """Softmax temperature; 0 is greedy."""
    top_k: int | None = 40
    """Sample among the k most likely tokens (None: all)."""
    seed: int = 0
    """Sampling seed."""


def main(cfg: SampleConfig) -> list[str]:
    """Print and **return** the samples."""
    model = load_model(cfg.run_dir)
    tok = ByteTokenizer()
    room = model.config.seq_len - len(tok.encode(cfg.prompt))
    if room < 1:
        raise ValueError(f"the prompt is {len(tok.encode(cfg.prompt))} bytes; the model sees at most {model.config.seq_len}.")
    n = min(cfg.max_new_tokens, room)
    if n < cfg.max_new_tokens:
        print(f"(generating {n} tokens: the model's context is {model.config.seq_len})")
    texts = generate_text(model, tok, cfg.prompt, n, key=jax.random.key(cfg.seed), num_samples=cfg.num_samples,
                          temperature=cfg.temperature, top_k=cfg.top_k)
    for i, t in enumerate(texts):
        print(f"--- sample {i} ---\n{t}")
    return texts


if __name__ == "__main__":
    main(tyro.cli(SampleConfig))
