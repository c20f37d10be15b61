"""The planner's predicted step against steps measured on one TPU v5e (`docs/measured/`).

For each case, `eqgpt-plan`'s own path compiles the step for a `v5e-1` from shapes (libtpu's
compile-only device; runs on any host with `eqgpt[tpu-plan]`) and predicts its step time with
the calibration table in `src/eqgpt/plan/calibration/` (`--calibration` for another). The
measured step comes from the run output committed under `docs/measured/`, read here, never
used to calibrate. Prints predicted and measured ms, and the error.

    python benchmarks/plan_vs_measured.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

MEASURED = Path(__file__).resolve().parent.parent / "docs" / "measured"
# name, eqgpt-plan flags (those of the measured run), its output file, how to read seconds per step from it
CASES = (
    ("gpt2-small", ["--model.preset", "gpt2-small", "--batch-size", "16", "--precision", "bf16"],
     "mfu_gpt2_flash.txt", "step"),
    ("gpt2-small-moe", ["--model.preset", "gpt2-small-moe", "--batch-size", "16", "--precision", "bf16"],
     "mfu_gpt2_moe_flash.txt", "step"),
    ("llama-1b", ["--model.preset", "llama-1b", "--batch-size", "5", "--precision", "bf16", "--master-weights",
                  "--optim.mu-dtype", "bf16", "--model.remat", "full"], "recipe_llama1b_guard.txt", "tokens"),
)


def measured_seconds(path: Path, how: str, tokens_per_step: int) -> float:
    """Seconds per step from a committed run output: its `step time N ms` line, or its last `tokens_per_s`."""
    text = path.read_text()
    if how == "step":
        return float(re.search(r"step time\s+([\d.]+) ms", text).group(1)) / 1e3
    rate = float(re.findall(r'"tokens_per_s": ([\d.]+)', text)[-1])
    return tokens_per_step / rate


def main(argv: list[str] | None = None) -> int:
    import tyro

    from eqgpt.cli.plan import PlanConfig, compiled_plan, record_of
    from eqgpt.plan.slices import parse_slice

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    slice_ = parse_slice("v5e-1")
    devices = slice_.devices()
    rows = []
    print(f"{'model':<16} {'predicted ms':>13} {'measured ms':>12} {'error':>8}  calibration")
    for name, flags, file, how in CASES:
        if name not in args.cases.split(","):
            continue
        cfg = tyro.cli(PlanConfig, args=[*flags, "--slice", "v5e-1"])
        compiled, strategy, model_cfg, policy = compiled_plan(cfg, slice_, devices)
        record = record_of(cfg, slice_, compiled, strategy, model_cfg, policy)
        measured = measured_seconds(MEASURED / file, how, cfg.batch_size * model_cfg.seq_len)
        predicted = record["time"]["step"]
        rows.append({"model": name, "predicted": predicted, "measured": measured,
                     "error": predicted / measured - 1, "time": record["time"], "calibration": record["calibration"]})
        error = 100 * (predicted / measured - 1)
        print(f"{name:<16} {1e3 * predicted:>13.1f} {1e3 * measured:>12.1f} {error:>+7.1f}%  {record['calibration']}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
