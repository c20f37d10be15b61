"""`eqgpt-sample`: generate text from a model trained by `eqgpt-train` (KV-cache decoding), on one device or a mesh.

    eqgpt-sample --prompt "def parse(" --temperature 0.7        # the newest run (runs/latest)
    eqgpt-sample --run-dir runs/nano-20261204-101500 --cpu-devices 8 --mesh data=2,tensor=4 --temperature 0
    eqgpt-sample --hf out/hf --prompt "Hello"                   # a Hugging Face GPT-2 / Llama directory

The tokenizer is the one the run recorded (`tokenizer.json` in the run directory;
none means bytes), or `--tokenizer`. The layers are built by the block factory the
run recorded (`model_config.json`), imported by its `module:name`, or `--block`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from eqgpt.cli import exit_on_user_error, parse_cli


@dataclass
class SampleConfig:
    """Load a trained model and continue a prompt."""

    run_dir: Path = Path("runs/latest")
    ("Output directory of a training run (holds model.eqx, model_config.json and tokenizer.json); default: the newest "
     "run.")
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
    block: str | None = None
    """Block factory that built the layers: a registered name or MODULE:NAME (default: the one the run recorded)."""
    imports: Annotated[tuple[str, ...], tyro.conf.arg(name="import"), tyro.conf.UseAppendAction] = ()
    """Import this module first (repeatable): a package that registers its kernels and blocks."""
    mesh: str = ""
    """Device mesh, e.g. 'data=2,tensor=4': heads over tensor, samples over data ('' = one device)."""
    strategy: str = "dp+tp"
    """Sharding rules on --mesh (as in eqgpt-train)."""
    cpu_devices: int | None = None
    """Simulate this many CPU devices (set before JAX starts), e.g. 8 to try --mesh on one machine."""


def check_flags(cfg: SampleConfig) -> None:
    """Refuse numbers no sampler can use, naming the flag."""
    bad = [("--max-new-tokens", cfg.max_new_tokens, cfg.max_new_tokens >= 1, "at least 1"),
           ("--num-samples", cfg.num_samples, cfg.num_samples >= 1, "at least 1"),
           ("--temperature", cfg.temperature, cfg.temperature >= 0, "at least 0 (0: greedy)"),
           ("--top-k", cfg.top_k, cfg.top_k is None or cfg.top_k >= 1, "at least 1 (or None: all)"),
           ("--top-p", cfg.top_p, cfg.top_p is None or 0 < cfg.top_p <= 1, "in (0, 1] (or None: off)"),
           ("--cpu-devices", cfg.cpu_devices, cfg.cpu_devices is None or cfg.cpu_devices >= 1, "at least 1")]
    for flag, value, ok, want in bad:
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {value}.")


def load_sampled_model(cfg: SampleConfig, strategy):
    """The model of --hf, or of --run-dir (saying which run `runs/latest` is)."""
    from eqgpt.train import load_model

    if cfg.hf is not None:
        from eqgpt.interop import load_hf

        if not Path(cfg.hf).exists():
            raise ValueError(f"--hf {cfg.hf} does not exist; pass a directory with config.json and model.safetensors.")
        try:
            model = load_hf(cfg.hf, strategy=strategy)[1]
        except (ValueError, OSError) as e:
            raise ValueError(f"--hf {cfg.hf}: {e}") from None
    else:
        run_dir = Path(cfg.run_dir).resolve()  # runs/latest: say which run it is
        if not run_dir.is_dir():
            raise ValueError(f"--run-dir {cfg.run_dir} is not a run directory; train one with eqgpt-train "
                             "(recipes/train_gpt.py) or pass --run-dir.")
        why = (" (runs/latest: the newest run trained under runs/; a run elsewhere needs --run-dir DIR)"
               if Path(cfg.run_dir) == Path("runs/latest") else "")
        print(f"loading run {run_dir}{why}", flush=True)
        try:
            model = load_model(run_dir, block_factory=cfg.block)
        except ValueError as e:
            raise ValueError(f"--block {cfg.block}: {e}" if cfg.block else str(e)) from None
    return model


def main(cfg: SampleConfig) -> list[str]:
    """Print and **return** the samples."""
    import jax

    from eqgpt.compile_cache import enable_compile_cache
    from eqgpt.nn.factory import import_modules

    check_flags(cfg)
    import_modules(cfg.imports)
    if cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    enable_compile_cache()  # the cache eqgpt-train fills: its end-of-run samples ran this very program
    from eqgpt.data import load_tokenizer
    from eqgpt.parallel import ParallelFlags
    from eqgpt.sample import generate_text

    try:
        strategy = ParallelFlags.parse(cfg.mesh, cfg.strategy) if cfg.mesh else None
    except ValueError as e:
        hint = " On a CPU, --cpu-devices N simulates N devices." if "devices" in str(e) and not cfg.cpu_devices else ""
        raise ValueError(f"--mesh {cfg.mesh}: {e}{hint}") from None
    model = load_sampled_model(cfg, strategy).scanned()  # as the trainer's samples: one program for both
    try:
        tok = load_tokenizer(cfg.tokenizer or (cfg.hf or cfg.run_dir))
    except (ValueError, OSError) as e:
        raise ValueError(f"--tokenizer {cfg.tokenizer}: {e}" if cfg.tokenizer else str(e)) from None
    try:
        n_prompt = len(tok.encode(cfg.prompt))
    except ValueError as e:
        raise ValueError(f"--prompt {cfg.prompt!r}: {e}") from None
    room = model.config.seq_len - n_prompt
    if room < 1:
        raise ValueError(f"--prompt is {n_prompt} tokens; the model sees at most {model.config.seq_len}.")
    n = min(cfg.max_new_tokens, room)
    if n < cfg.max_new_tokens:
        print(f"(generating {n} tokens: the model's context is {model.config.seq_len})")
    start = time.perf_counter()
    texts = generate_text(model, tok, cfg.prompt, n, key=jax.random.key(cfg.seed), num_samples=cfg.num_samples,
                          temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, stop=cfg.stop,
                          strategy=strategy)
    seconds = time.perf_counter() - start
    for i, t in enumerate(texts):
        print(f"--- sample {i} ---\n{t}")
    print(f"({cfg.num_samples} x {n} tokens in {seconds:.2f} s: {cfg.num_samples * n / seconds:,.0f} tokens/s "
          "with the compilation; benchmarks/generate_speed.py times decoding alone)")
    return texts


def run(args: list[str] | None = None) -> None:
    """The console script `eqgpt-sample`: flags -> `main`; a user error is one line and exit status 1."""
    exit_on_user_error(lambda: main(parse_cli(SampleConfig, args=args)), args=args)


if __name__ == "__main__":
    run()
