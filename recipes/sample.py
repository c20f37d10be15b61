"""Generate text from a model trained by `recipes/train_gpt.py` (KV-cache decoding), on one device or a mesh.

    .venv/bin/python recipes/sample.py --prompt "def parse(" --temperature 0.7   # the newest run (runs/latest)
    .venv/bin/python recipes/sample.py --run-dir runs/nano-20261204-101500 --cpu-devices 8 --mesh data=2,tensor=4 --temperature 0
    .venv/bin/python recipes/sample.py --hf out/hf --prompt "Hello"      # a Hugging Face GPT-2 / Llama directory

The tokenizer is the one the run recorded (`tokenizer.json` in the run directory;
none means bytes), or `--tokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import tyro

from eqgpt.data import load_tokenizer
from eqgpt.sample import generate_text
from eqgpt.train import load_model


@dataclass
class SampleConfig:
    """Load a trained model and continue a prompt."""

    run_dir: Path = Path("runs/latest")
    """Output directory of a training run (holds model.eqx, model_config.json and tokenizer.json); default: the newest run."""
    hf: Path | None = None
    """Instead of --run-dir: a Hugging Face GPT-2 / Llama directory (config.json + model.safetensors)."""
    tokenizer: str | None = None
    """Tokenizer: 'bytes', a tokenizer.json, a GPT-2 vocab.json (default: the one the run recorded)."""
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
    top_p: float | None = None
    """Nucleus sampling: among the most likely tokens holding this much probability (None: off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: each sample ends before the first one after the prompt (and at end-of-text)."""
    seed: int = 0
    """Sampling seed."""
    mesh: str = ""
    """Device mesh, e.g. 'data=2,tensor=4': heads over tensor, samples over data ('' = one device)."""
    strategy: str = "dp+tp"
    """Sharding rules on --mesh (as in train_gpt.py)."""
    cpu_devices: int | None = None
    """Simulate this many CPU devices (set before JAX starts), e.g. 8 to try --mesh on one machine."""


def main(cfg: SampleConfig) -> list[str]:
    """Print and **return** the samples."""
    if cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    from eqgpt.parallel import Strategy

    strategy = Strategy.parse(cfg.mesh, cfg.strategy) if cfg.mesh else None
    if cfg.hf is not None:
        from eqgpt.interop import load_hf

        model = load_hf(cfg.hf, strategy=strategy)[1]
    else:
        run_dir = Path(cfg.run_dir).resolve()  # runs/latest: say which run it is
        if not run_dir.is_dir():
            raise SystemExit(f"error: no run directory {cfg.run_dir}; train one with recipes/train_gpt.py or pass --run-dir.")
        print(f"loading run {run_dir}", flush=True)
        model = load_model(run_dir)
    tok = load_tokenizer(cfg.tokenizer or (cfg.hf or cfg.run_dir))
    n_prompt = len(tok.encode(cfg.prompt))
    room = model.config.seq_len - n_prompt
    if room < 1:
        raise ValueError(f"the prompt is {n_prompt} tokens; the model sees at most {model.config.seq_len}.")
    n = min(cfg.max_new_tokens, room)
    if n < cfg.max_new_tokens:
        print(f"(generating {n} tokens: the model's context is {model.config.seq_len})")
    texts = generate_text(model, tok, cfg.prompt, n, key=jax.random.key(cfg.seed), num_samples=cfg.num_samples,
                          temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop=cfg.stop,
                          strategy=strategy)
    for i, t in enumerate(texts):
        print(f"--- sample {i} ---\n{t}")
    return texts


if __name__ == "__main__":
    try:
        main(tyro.cli(SampleConfig))
    except ValueError as e:  # a prompt, tokenizer or run this cannot use: say what, no traceback
        raise SystemExit(f"error: {e}") from None
