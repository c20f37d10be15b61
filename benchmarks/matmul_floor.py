"""How much of a training step is the matmul library: every matmul of eqgpt's step, timed alone in XLA and in PyTorch.

The step's `dot_general`s are read from its jaxpr (forward and backward, a scanned
body counted once per layer). Each distinct product is then timed alone, as a
jitted `lax.dot_general` and as the same `torch.einsum`, in alternating calls (median
of `--repeats`). The sums are the time a step needs for its matmuls alone in each
library: if XLA's sum is above PyTorch's whole step, no reordering of eqgpt's
program can bring the step to PyTorch's time on this CPU.

Needs PyTorch for its column (`pip install 'eqgpt[bench]'`); without it, the XLA column only.
Run: `python benchmarks/matmul_floor.py [--layers 4 --embed 256 --seq 256 --batch 8]`
(the configuration of the speed issue by default).
"""

from __future__ import annotations

import argparse
import collections
import string
import time

import equinox as eqx
import jax
import jax.extend.core
import numpy as np

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT, lm_loss


def dot_shapes(jaxpr, times: int = 1, out=None) -> collections.Counter:
    """(lhs shape, rhs shape, dimension numbers) -> how many times the step runs it."""
    out = collections.Counter() if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            dims = tuple(tuple(map(tuple, d)) for d in eqn.params["dimension_numbers"])
            out[(lhs, rhs, dims)] += times
        reps = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            dot_shapes(sub, reps, out)
    return out


def einsum_spec(lhs, rhs, dims) -> str:
    """The `torch.einsum` string of a `dot_general` (batch dims, then free lhs, then free rhs)."""
    (lc, rc), (lb, rb) = dims
    letters = iter(string.ascii_letters)
    a = [next(letters) for _ in lhs]
    b = [None] * len(rhs)
    for i, j in zip(lb, rb, strict=True):
        b[j] = a[i]
    for i, j in zip(lc, rc, strict=True):
        b[j] = a[i]
    b = [x or next(letters) for x in b]
    out = [a[i] for i in lb] + [a[i] for i in range(len(lhs)) if i not in lb + lc] + \
          [b[j] for j in range(len(rhs)) if j not in rb + rc]
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}"


def median_ms(f, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    try:
        import torch
    except ImportError:
        torch = None

    cfg = eqgpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers, num_heads=args.heads,
                          embed_dim=args.embed, use_bias=False, tie_embeddings=True, attention_kernel="reference")
    model = GPT(cfg, key=jax.random.key(0))
    windows = np.zeros((args.batch, cfg.seq_len + 1), np.int32)
    batch = Batch.from_windows(windows)
    grad = eqx.filter_value_and_grad(lambda m: lm_loss(m, batch.tokens, batch.targets)[0])
    shapes = dot_shapes(jax.make_jaxpr(lambda m: grad(m))(model).jaxpr)

    rows, total = [], {"xla": 0.0, "torch": 0.0}
    for (lhs, rhs, dims), count in sorted(shapes.items(), key=lambda kv: -kv[1]):
        a = jax.random.normal(jax.random.key(1), lhs)
        b = jax.random.normal(jax.random.key(2), rhs)
        f = jax.jit(lambda a, b, dims=dims: jax.lax.dot_general(a, b, dims))
        xla = median_ms(lambda f=f, a=a, b=b: jax.block_until_ready(f(a, b)), args.repeats)
        spec = einsum_spec(lhs, rhs, dims)
        if torch is not None:
            ta, tb = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))
            pt = median_ms(lambda spec=spec, ta=ta, tb=tb: torch.einsum(spec, ta, tb), args.repeats)
        else:
            pt = float("nan")
        flops = 2 * np.prod(lhs) * np.prod([rhs[j] for j in range(len(rhs)) if j not in dims[0][1] + dims[1][1]])
        rows.append((spec, lhs, rhs, count, xla, pt, flops))
        total["xla"] += count * xla
        total["torch"] += count * pt

    print(f"model: L={cfg.num_layers} H={cfg.num_heads} D={cfg.embed_dim} T={cfg.seq_len} B={args.batch} "
          f"vocab={cfg.vocab_size}; jax {jax.__version__}"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ", no torch"))
    print(f"\n{'einsum':<22} {'lhs':<18} {'rhs':<18} {'per step':>8} {'XLA ms':>7} {'GFLOP/s':>7} "
          f"{'torch ms':>8} {'GFLOP/s':>7}")
    for spec, lhs, rhs, count, xla, pt, flops in rows:
        print(f"{spec:<22} {str(lhs):<18} {str(rhs):<18} {count:>8} {xla:7.2f} {flops / xla / 1e6:7.0f} "
              f"{pt:8.2f} {flops / pt / 1e6:7.0f}")
    print(f"\nall matmuls of one forward + backward, each alone: XLA {total['xla']:.0f} ms, "
          f"PyTorch {total['torch']:.0f} ms (ratio {total['xla'] / total['torch']:.2f})")


if __name__ == "__main__":
    main()
