"""Grouped matmul forward + backward time: `ragged_dot` against the Pallas `megablox` kernel.

One expert MLP's up projection and down projection over `--tokens * --top-k` rows sorted by
expert, with the rows spread over the experts as a router would (multinomial around uniform,
`--skew` shifting load to expert 0). Each cell is the median of `--repeats` calls of one
compiled `value_and_grad`, in ms. The `auto` choice (`eqgpt.nn.kernels.grouped`) follows it.

    python benchmarks/grouped_matmul_speed.py                      # TPU: GPT-2-small-width MoE
    python benchmarks/grouped_matmul_speed.py --cpu --tokens 512   # a check of this script
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from eqgpt.nn.kernels.grouped import grouped_matmul
from eqgpt.profile.timing import median_seconds


def expert_mlp_time(kernel: str, rows: int, embed: int, hidden: int, sizes: np.ndarray, dtype, repeats: int,
                    tile=None) -> float:
    """Median seconds of forward + backward of `down(gelu(up(x)))` grouped by expert."""
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (rows, embed), dtype)
    up = jax.random.normal(ks[1], (len(sizes), embed, hidden), dtype) * embed**-0.5
    down = jax.random.normal(ks[2], (len(sizes), hidden, embed), dtype) * hidden**-0.5
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(x, up, down):
        mm = lambda a, w: grouped_matmul(a, w, group_sizes, kernel=kernel, **({"tile": tile} if tile else {}))  # noqa: E731
        return jnp.sum(mm(jax.nn.gelu(mm(x, up)), down).astype(jnp.float32))

    return median_seconds(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), x, up, down, repeats=repeats)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", default="8,16,64", help="comma-separated expert counts")
    p.add_argument("--embed", type=int, default=768)
    p.add_argument("--hidden", type=int, default=1536, help="one expert's width")
    p.add_argument("--skew", type=float, default=0.0, help="extra share of the rows on expert 0")
    p.add_argument("--tiles", default="", help="megablox tiles to compare, e.g. 128x128x128,512x768x768 "
                   "(default: its default tile only)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run without an accelerator (a check of this script)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.cpu:
        print("no accelerator here: pass --cpu (with a small --tokens) to check the script.")
        return 0
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    rows = args.tokens * args.top_k
    print(f"expert MLP forward + backward, {rows} rows ({args.tokens} tokens x top-{args.top_k}), "
          f"{args.embed} -> {args.hidden} -> {args.embed}, {jnp.dtype(dtype).name}; {device.device_kind}; "
          f"jax {jax.__version__}; median of {args.repeats}, ms")
    tiles = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",") if t] or [None]
    names = ["megablox" if t is None else "x".join(map(str, t)) for t in tiles]
    print(f"{'experts':>8}{'ragged_dot':>12}" + "".join(f"{n:>14}" for n in names))
    for e in (int(n) for n in args.experts.split(",")):
        share = np.full(e, (1 - args.skew) / e)
        share[0] += args.skew
        sizes = np.random.default_rng(0).multinomial(rows, share)
        base = expert_mlp_time("ragged_dot", rows, args.embed, args.hidden, sizes, dtype, args.repeats) * 1e3
        cells = [expert_mlp_time("megablox", rows, args.embed, args.hidden, sizes, dtype, args.repeats, t) * 1e3
                 for t in tiles]
        print(f"{e:>8}{base:>12.2f}" + "".join(f"{c:>14.2f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
