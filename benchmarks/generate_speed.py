"""Generation speed: prefill tokens/s and MFU; decode tokens/s against the HBM roofline.

Times `eqgpt.sample.generate` itself (greedy, no stop tokens, weights cast once to
`--dtype`). A decode step's time is `(generate - prefill) / (new - 1)`, both medians of
`--repeats` calls, so the prefill and the dispatch drop out. The roofline is
`eqgpt.profile.roofline`: every weight and the mean filled cache read once per step, over
the chip's HBM bandwidth.

    python benchmarks/generate_speed.py                                  # TPU: gpt2-small
    python benchmarks/generate_speed.py --check-cpu --dtype fp32 --batches 4
    python benchmarks/generate_speed.py --cpu --preset nano --batches 1,2 --prefill-batch 2
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqgpt
from eqgpt.nn.gpt import GPT
from eqgpt.profile.flops import flops_per_token, peak_flops
from eqgpt.profile.roofline import decode_step_bytes, hbm_bandwidth
from eqgpt.profile.timing import median_seconds
from eqgpt.sample import generate, prefill

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def cast(model: GPT, dtype) -> GPT:
    """The model with its floating-point arrays in `dtype` (once, before any call)."""
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


def prompts(cfg, batch: int, length: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, length)), jnp.int32)


def prefill_seconds(model: GPT, prompt: jax.Array, max_len: int, repeats: int) -> float:
    run = eqx.filter_jit(lambda m, p: prefill(m, p, max_len)[0][:, -1])
    return median_seconds(run, model, prompt, repeats=repeats)


def generate_seconds(model: GPT, prompt: jax.Array, new: int, repeats: int) -> float:
    key = jax.random.key(0)
    return median_seconds(lambda m, p: generate(m, p, new, key=key, temperature=0.0), model, prompt,
                          repeats=repeats)


def check_cpu(model: GPT, prompt: jax.Array, new: int) -> str:
    """Greedy tokens here and on the CPU, same weights, fp32 matmuls at full precision."""
    with jax.default_matmul_precision("highest"):
        here = np.asarray(generate(model, prompt, new, key=jax.random.key(0), temperature=0.0))
        cpu = jax.devices("cpu")[0]
        there = np.asarray(generate(jax.device_put(model, cpu), jax.device_put(prompt, cpu), new,
                                    key=jax.random.key(0), temperature=0.0))
    same = int((here == there).all(axis=1).sum())
    first = np.argmax((here != there).any(axis=0)) if same < len(here) else None
    return f"greedy output equal to the CPU's: {same} of {len(here)} rows" + (
        "" if first is None else f" (first difference at position {first})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--batches", default="1,8,64", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt", type=int, default=128, help="prompt length for decoding")
    p.add_argument("--new", type=int, default=128, help="tokens generated per row")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=None, help="prefill length (default: the preset's seq_len)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-cpu", action="store_true", help="compare greedy output with the CPU's instead")
    p.add_argument("--cpu", action="store_true", help="run without an accelerator (a check of this script)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.cpu:
        print("no accelerator here: pass --cpu with a small --preset to check the script.")
        return 0
    cfg = eqgpt.preset(args.preset)
    model = cast(GPT(cfg, key=jax.random.key(0)), DTYPES[args.dtype])
    batches = [int(b) for b in args.batches.split(",")]
    if args.check_cpu:
        for b in batches:
            print(f"{args.preset}, batch {b}, {args.dtype}, {args.new} new tokens: "
                  + check_cpu(model, prompts(cfg, b, args.prompt), args.new))
        return 0
    bandwidth = hbm_bandwidth(device)
    peak, _ = peak_flops(device)
    print(f"{args.preset}, {args.dtype} weights and cache, greedy; {device.device_kind}; jax {jax.__version__}; "
          f"median of {args.repeats}; HBM {'n/a' if bandwidth is None else f'{bandwidth / 1e9:.0f} GB/s'}")
    length = args.prefill_len or cfg.seq_len
    prompt = prompts(cfg, args.prefill_batch, length)
    seconds = prefill_seconds(model, prompt, length, args.repeats)
    tokens = args.prefill_batch * length
    mfu = tokens / seconds * flops_per_token(cfg, length) / 3 / peak
    print(f"prefill {args.prefill_batch} x {length}: {seconds * 1e3:.2f} ms, {tokens / seconds:,.0f} tokens/s, "
          f"{mfu:.1%} MFU (forward FLOPs)")
    print(f"decode: prompt {args.prompt}, {args.new} new tokens per row")
    print(f"{'batch':>6}{'ms/step':>10}{'tokens/s':>12}{'MB read':>10}{'roofline ms':>13}{'of roofline':>13}")
    itemsize = jnp.dtype(DTYPES[args.dtype]).itemsize
    for b in batches:
        prompt = prompts(cfg, b, args.prompt)
        total = generate_seconds(model, prompt, args.new, args.repeats)
        first = prefill_seconds(model, prompt, args.prompt + args.new, args.repeats)
        step = (total - first) / (args.new - 1)
        need = decode_step_bytes(model, b, args.prompt + args.new / 2, itemsize)
        floor = None if bandwidth is None else need / bandwidth
        cells = ("n/a", "n/a") if floor is None else (f"{floor * 1e3:.3f}", f"{floor / step:.0%}")
        print(f"{b:>6}{step * 1e3:>10.3f}{b / step:>12,.0f}{need / 1e6:>10.1f}{cells[0]:>13}{cells[1]:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
