"""Attention forward + backward time per kernel and sequence length, at a fixed number of tokens.

For each length T the batch is `--tokens / T` rows, so every row of the table does the
same useful work per token up to the quadratic term. Kernels: eqgpt's `reference`,
`blockwise`, `splash` and `flash`, and `xla` (`jax.nn.dot_product_attention(implementation="xla")`).
Each cell is the median of `--repeats` calls of one compiled `value_and_grad`; a kernel that
runs out of memory prints `OOM`.

`--sweep` instead times `splash` at each length over block sizes (`--blocks`) and prints
the fastest, the rows of `eqgpt.nn.kernels.splash.BLOCK_TABLE`; then `flash` over
`--flash-blocks` (`eqgpt.nn.kernels.flash.BLOCK`).

    python benchmarks/attention_speed.py                       # TPU: T 512..8192, 16k tokens, bf16
    python benchmarks/attention_speed.py --sweep
    python benchmarks/attention_speed.py --cpu                 # CPU: reference vs blockwise (auto's rule)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from eqgpt.nn.kernels import flash, get_kernel, splash
from eqgpt.nn.mask import CausalMask
from eqgpt.profile.timing import median_seconds


def attention_fn(name: str):
    """`f(q, k, v) -> out`, causal, for a kernel name or `xla`."""
    if name == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    kernel = get_kernel(name)

    def f(q, k, v):
        pos = jnp.arange(q.shape[1])
        return kernel(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos)

    return f


def time_fwd_bwd(f, shape_q, shape_kv, dtype, repeats: int) -> float:
    """Median seconds of one forward + backward of `f` on random inputs."""
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], shape_q, dtype)
    k, v = jax.random.normal(ks[1], shape_kv, dtype), jax.random.normal(ks[2], shape_kv, dtype)
    ct = jax.random.normal(ks[3], shape_q, dtype)
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)), argnums=(0, 1, 2)))
    return median_seconds(step, q, k, v, repeats=repeats)


def cell(f, *args) -> str:
    try:
        return f"{time_fwd_bwd(f, *args) * 1e3:.2f}"
    except Exception as e:  # noqa: BLE001  (out of memory, or a shape a kernel refuses)
        return "OOM" if "RESOURCE_EXHAUSTED" in str(e) or "memory" in str(e).lower() else "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default=None, help="comma-separated lengths (TPU: 512..8192; --cpu: 128..2048)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per call (TPU: 16384; --cpu: 4096)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help="default: bf16 (TPU), fp32 (CPU)")
    p.add_argument("--kernels", default=None, help="comma-separated (TPU: blockwise,reference,xla,splash,flash)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="time splash over --blocks at each length")
    p.add_argument("--blocks", default="512x512,1024x1024,512x512f,1024x512f,512x1024f,1024x1024f",
                   help="QxKV block sizes; a trailing f runs the fused backward kernel")
    p.add_argument("--flash-blocks", default="256,512,1024", help="block sizes --sweep times flash at")
    p.add_argument("--cpu", action="store_true", help="the CPU table (reference vs blockwise)")
    args = p.parse_args(argv)
    platform = jax.devices()[0].platform
    if platform == "cpu" and not args.cpu:
        print("no accelerator here: pass --cpu for the CPU table (reference vs blockwise).")
        return 0
    cpu = platform == "cpu"
    seqs = [int(s) for s in (args.seqs or ("128,256,512,1024,2048" if cpu else "512,1024,2048,4096,8192")).split(",")]
    tokens = args.tokens or (4096 if cpu else 16384)
    dtype = jnp.dtype(args.dtype or ("float32" if cpu else "bfloat16"))
    kernels = (args.kernels or ("reference,blockwise" if cpu else "blockwise,reference,xla,splash,flash")).split(",")
    h, g, d = args.heads, args.kv_heads or args.heads, args.head_dim
    print(f"attention forward + backward, causal, {tokens} tokens per call, heads {h}/{g} kv, head_dim {d}, "
          f"{dtype.name}; {jax.devices()[0].device_kind}; jax {jax.__version__}; median of {args.repeats}, ms")
    if args.sweep:
        names = args.blocks.split(",")
        blocks = [splash.Blocks(*(int(x) for x in b.rstrip("f").split("x")), b.endswith("f")) for b in names]
        print("T".rjust(6) + "".join(n.rjust(11) for n in names) + "   fastest")
        for t in seqs:
            b = max(tokens // t, 1)
            row = []
            for blk in blocks:
                if blk.q > t or blk.kv > t:
                    row.append("-")
                    continue
                splash.BLOCK_TABLE.clear()
                splash.BLOCK_TABLE[(t, d, dtype.name)] = blk
                row.append(cell(attention_fn("splash"), (b, t, h, d), (b, t, g, d), dtype, args.repeats))
            times = {blk: float(c) for blk, c in zip(blocks, row, strict=True) if c not in ("-", "OOM", "n/a")}
            best = names[blocks.index(min(times, key=times.get))] if times else None
            print(f"{t:6d}" + "".join(c.rjust(11) for c in row) + f"   {best}")
        sizes = [int(x) for x in args.flash_blocks.split(",")]
        print("flash, block:\n" + "T".rjust(6) + "".join(str(n).rjust(11) for n in sizes))
        for t in seqs:
            row = []
            for n in sizes:
                flash.BLOCK = n
                row.append("-" if n > t else cell(attention_fn("flash"), (max(tokens // t, 1), t, h, d),
                                                  (max(tokens // t, 1), t, g, d), dtype, args.repeats))
            print(f"{t:6d}" + "".join(c.rjust(11) for c in row))
        return 0
    print("T".rjust(6) + "batch".rjust(7) + "".join(k.rjust(11) for k in kernels))
    for t in seqs:
        b = max(tokens // t, 1)
        row = [cell(attention_fn(k), (b, t, h, d), (b, t, g, d), dtype, args.repeats) for k in kernels]
        print(f"{t:6d}{b:7d}" + "".join(c.rjust(11) for c in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
