"""int8 against bf16 on one accelerator: one MFU table, each row a training step of the same model.

Rows: bf16; `--precision int8` with the straight-through backward (`qat`); int8 with int8
gradient matmuls too (`qt`). Each runs `accelerator_mfu.measure` (AdamW, fp32 parameters,
random tokens, median of `--steps` timed steps after `--warmup`). MFU counts the model's
bf16-equivalent FLOPs (6 per weight per token plus causal attention) against the chip's bf16
dense peak, as every MFU in `docs/profiling_results.md` does, so int8 can exceed what bf16 reaches.

    python benchmarks/int8_mfu.py --preset gpt2-small --batch 16

Without an accelerator it says so and exits 0, unless `--cpu` asks for a (small) CPU run.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import jax

import eqgpt
from eqgpt.config import scans_by_default

ROWS = (("bf16", "bf16", "qat"), ("int8 qat", "int8", "qat"), ("int8 qt", "int8", "qt"))


def _accelerator_mfu():
    spec = importlib.util.spec_from_file_location("accelerator_mfu", Path(__file__).with_name("accelerator_mfu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--kernel", default="auto", help="attention kernel (default auto: flash or splash on TPU)")
    p.add_argument("--remat", default=None, help="remat policy (default: the preset's)")
    p.add_argument("--rows", default=",".join(r[0] for r in ROWS),
                   help=f"comma-separated rows to run, of: {', '.join(r[0] for r in ROWS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="run even without an accelerator (a check of this script)")
    args = p.parse_args(argv)
    rows = [r for r in ROWS if r[0] in args.rows.split(",")]
    if not rows:
        p.error(f"--rows {args.rows}: choose from {', '.join(r[0] for r in ROWS)}")
    device = jax.devices()[0]
    if device.platform not in ("gpu", "tpu") and not args.cpu:
        print(f"no GPU or TPU here (JAX sees {device.platform}); run this on an accelerator, or pass --cpu "
              "with a small --preset to check the script.")
        return 0
    cfg = eqgpt.preset(args.preset, attention_kernel=args.kernel,
                       scan_layers=scans_by_default(eqgpt.preset(args.preset).num_layers, device.platform),
                       **({"remat": args.remat} if args.remat else {}))
    measure = _accelerator_mfu().measure
    print(f"{args.preset}, batch {args.batch} x {cfg.seq_len}, {args.kernel} attention, remat {cfg.remat}, layers "
          f"{'scanned' if cfg.scan_layers else 'unrolled'}; {device.device_kind}; jax {jax.__version__}; "
          f"median of {args.steps} steps; MFU in bf16-equivalent FLOPs")
    print("| matmuls | step time | tokens/s | MFU | vs bf16 | compiled step peak | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for name, precision, backward in rows:
        r = measure(cfg, batch=args.batch, precision=precision, int8_backward=backward, steps=args.steps,
                    warmup=args.warmup)
        base = r["tokens_per_s"] if name == "bf16" else base
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        peak = "n/a" if r["compiled_bytes"] is None else f"{r['compiled_bytes'] / 2**30:.2f} GiB"
        print(f"| {name} | {r['seconds'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {ratio} | "
              f"{peak} | {r['loss']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
