"""Bits per byte of short training runs with different tokenizers: the comparable metric.

Validation loss in nats/token depends on the tokenizer (a BPE token carries several
bytes); bits per byte (`val_bpb = val_loss / ln 2 / bytes_per_token`, the bytes
counted over the very validation targets) does not. This runs the default recipe
(`nano`, the stdlib corpus, batch 32, seq 128) for `--steps` steps with each
tokenizer and prints one table row per run, plus the tokenizer's training time.

Run: `python benchmarks/bits_per_byte.py [--steps 200] [--tokenizers bytes bpe:4096]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import train_gpt  # noqa: E402
from eqgpt.data import load_corpus  # noqa: E402


def run(tokenizer: str, steps: int, out: Path, cache: Path) -> dict:
    t0 = time.perf_counter()
    corpus = load_corpus("stdlib", cache_dir=cache, tokenizer=tokenizer)  # trains and caches BPE once
    prep = time.perf_counter() - t0
    cfg = train_gpt.TrainConfig(steps=steps, eval_every=max(steps // 4, 1), out_dir=out / tokenizer.replace(":", "_"),
                                sample_tokens=0, progress=False)
    cfg.data.tokenizer, cfg.data.cache_dir = tokenizer, cache
    summary = train_gpt.main(cfg)
    rows = [json.loads(x) for x in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    return {"tokenizer": tokenizer, "vocab": corpus.vocab_size, "prep_s": prep,
            "bytes_per_token": last["val_loss"] / last["val_bpb"] / 0.6931471805599453,
            "val_nats_per_token": last["val_loss"], "val_bits_per_byte": last["val_bpb"],
            "train_s": summary["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tokenizers", nargs="+", default=["bytes", "bpe:4096"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(t, args.steps, Path(tmp) / "runs", Path(tmp) / "cache") for t in args.tokenizers]
    print(f"\n{args.steps} steps of nano (batch 32 x 128 tokens) on the stdlib corpus")
    print("| tokenizer | vocab | tokenizer train + tokenize (s) | bytes/token | val nats/token | val bits/byte "
          "| run (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['tokenizer']} | {r['vocab']} | {r['prep_s']:.1f} | {r['bytes_per_token']:.2f} | "
              f"{r['val_nats_per_token']:.3f} | {r['val_bits_per_byte']:.3f} | {r['train_s']:.0f} |")


if __name__ == "__main__":
    main()
