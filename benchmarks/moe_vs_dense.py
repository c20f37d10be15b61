"""Mixture-of-Experts against the dense model of equal active parameters, at equal steps.

Trains `nano` and `moe-nano` (8 experts of half nano's MLP width, top-2: the same
parameters per token, 4x the feed-forward parameters in all) with the default recipe
(the stdlib corpus, batch 32 x 128 tokens, one device) for `--steps` steps each, and
prints one table row per model: validation loss, training tokens/s (median over the
logged steps after the first), and, for the MoE model, the drop rate and the busiest
expert's load over the mean (1.0 is balanced), both averaged over the last quarter of
the run.

Run: `python benchmarks/moe_vs_dense.py [--steps 800] [--presets nano moe-nano]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import train_gpt  # noqa: E402


def run(preset: str, steps: int, out: Path, cache: Path, extra: dict) -> dict:
    cfg = train_gpt.TrainConfig(steps=steps, eval_every=steps, out_dir=out / preset, sample_tokens=0,
                                progress=False, log_every=10, **extra)
    cfg.model.preset, cfg.data.cache_dir = preset, cache
    summary = train_gpt.main(cfg)
    rows = [json.loads(x) for x in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    tail = train[-max(len(train) // 4, 1):]
    mean = lambda key: statistics.fmean(r[key] for r in tail) if key in tail[0] else None  # noqa: E731
    return {"preset": preset, "val_loss": [r for r in rows if "val_loss" in r][-1]["val_loss"],
            "train_loss": mean("loss"), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train
                                                                          if "tokens_per_s" in r),
            "drop_rate": mean("moe_drop_rate"), "load_max": mean("moe_load_max"), "seconds": summary["seconds"]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=800, help="the recipe's default")
    p.add_argument("--presets", nargs="+", default=["nano", "moe-nano"])
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(name, args.steps, Path(tmp) / "runs", Path(tmp) / "cache", {"batch_size": args.batch_size})
                   for name in args.presets]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{args.steps} steps (batch {args.batch_size} x 128 tokens) on the stdlib corpus, one device")
    print("| model | val loss | train loss (last quarter) | tokens/s | drop rate | expert load max/mean | run (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['preset']} | {r['val_loss']:.3f} | {r['train_loss']:.3f} | {r['tokens_per_s']:,.0f} | "
              f"{fmt(r['drop_rate'], '.1%')} | {fmt(r['load_max'], '.2f')} | {r['seconds']:.0f} |")
    return results


if __name__ == "__main__":
    main()
