"""How much of a training step is the matmul library: the step against its matmuls alone in XLA (and PyTorch).

The step is the recipe's (`make_train_step`, AdamW with clipping, layers unrolled).
Its `dot_general`s are read from its jaxpr (forward, backward and update; a scanned
body counted once per layer). Each distinct product is then timed alone, as a
jitted `lax.dot_general` and as the same `torch.einsum`. The step and every XLA
product are timed in the same rounds, one call each per round (median of
`--repeats`), so a change of load reaches them alike; PyTorch's products in rounds
of their own. step / XLA matmuls is taken per round, then its median.

- step / XLA matmuls: the whole step over the time its matmuls take alone in XLA,
  the JAX floor of this CPU (1 would be a step that is nothing but its matmuls).
- XLA / PyTorch matmuls: if XLA's sum is above PyTorch's whole step, no reordering
  of eqgpt's program can bring the step to PyTorch's time on this CPU.

Needs PyTorch for its column (`pip install 'eqgpt[bench]'`); without it (or with
`--no-torch`), the XLA column only.
Run: `python benchmarks/matmul_floor.py [--sizes issue,nano] [--size L H D T B V] [--repeats 15]`
(the sizes of `benchmarks/vs_pytorch.py`: the speed issue's and the recipe's nano).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import string
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.extend.core
import numpy as np

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.train import TrainState, make_optimizer, make_train_step


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


def sizes() -> dict[str, tuple[int, ...]]:
    """The named sizes of `benchmarks/vs_pytorch.py`: name -> (layers, heads, embed, seq, batch, vocab)."""
    spec = importlib.util.spec_from_file_location("vs_pytorch_sizes", Path(__file__).with_name("vs_pytorch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SIZES


def interleaved_ms(fns: dict, repeats: int) -> dict[str, np.ndarray]:
    """Milliseconds of each callable in each of `repeats` rounds that call each once in turn
    (so a change of machine load reaches all of them alike), after one warm-up call each."""
    for f in fns.values():
        f()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: np.array(ts) * 1e3 for name, ts in times.items()}


def training_step(cfg: eqgpt.GPTConfig, batch_size: int):
    """The recipe's step at `cfg` (AdamW with decay and clipping, layers unrolled); **returns**
    `(run one step and wait, the step's jaxpr)`."""
    cfg = cfg.replace(scan_layers=False)
    opt = make_optimizer(1e-3, weight_decay=0.1, clip_norm=1.0)
    model = eqx.filter_jit(lambda k: GPT(cfg, key=k))(jax.random.key(0))
    box = [TrainState(model, eqx.filter_jit(opt.init)(eqx.filter(model, eqx.is_array)), rng=jax.random.key(1))]
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)
    batch = Batch.from_windows(windows)
    step = make_train_step(opt)
    jaxpr = jax.make_jaxpr(lambda s, b: step(s, b))(box[0], batch).jaxpr

    def run():
        box[0], metrics = step(box[0], batch)
        jax.block_until_ready(metrics)

    return run, jaxpr


def floor(size: tuple[int, ...], repeats: int, torch=None) -> dict:
    """Time the step and each of its matmuls alone (XLA, and PyTorch if given), interleaved;
    **returns** the rows and sums."""
    layers, heads, embed, seq, batch_size, vocab = size
    cfg = eqgpt.GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, num_heads=heads, embed_dim=embed,
                          use_bias=False, tie_embeddings=True, attention_kernel="reference")
    run_step, jaxpr = training_step(cfg, batch_size)
    shapes = sorted(dot_shapes(jaxpr).items(), key=lambda kv: -kv[1])
    fns, torch_fns, specs = {"step": run_step}, {}, {}
    for i, ((lhs, rhs, dims), _count) in enumerate(shapes):
        a = jax.random.normal(jax.random.key(1), lhs)
        b = jax.random.normal(jax.random.key(2), rhs)
        f = jax.jit(lambda a, b, dims=dims: jax.lax.dot_general(a, b, dims))
        fns[f"xla{i}"] = lambda f=f, a=a, b=b: jax.block_until_ready(f(a, b))
        specs[i] = einsum_spec(lhs, rhs, dims)
        if torch is not None:
            ta, tb = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))
            torch_fns[f"torch{i}"] = lambda spec=specs[i], ta=ta, tb=tb: torch.einsum(spec, ta, tb)
    rounds = interleaved_ms(fns, repeats)
    # PyTorch's products in rounds of their own: between XLA calls its idle OpenMP threads
    # (and XLA's between its) would take the cores from the other library.
    rounds.update(interleaved_ms(torch_fns, repeats))
    ms = {name: float(np.median(ts)) for name, ts in rounds.items()}
    # step / matmuls per round (a round's step and products ran seconds apart), then the median
    floor_per_round = sum(count * rounds[f"xla{i}"] for i, (_, count) in enumerate(shapes))
    ratios = rounds["step"] / floor_per_round
    rows, total = [], {"xla": 0.0, "torch": 0.0}
    for i, ((lhs, rhs, dims), count) in enumerate(shapes):
        xla, pt = ms[f"xla{i}"], ms.get(f"torch{i}", float("nan"))
        flops = 2 * np.prod(lhs) * np.prod([rhs[j] for j in range(len(rhs)) if j not in dims[0][1] + dims[1][1]])
        rows.append((specs[i], lhs, rhs, count, xla, pt, flops))
        total["xla"] += count * xla
        total["torch"] += count * pt
    return {"cfg": cfg, "batch": batch_size, "rows": rows, "total": total, "step": ms["step"],
            "ratio": float(np.median(ratios)), "ratio_range": (float(ratios.min()), float(ratios.max()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="issue,nano", help="comma-separated names of benchmarks/vs_pytorch.py's sizes")
    p.add_argument("--size", type=int, nargs=6, default=None,
                   metavar=("LAYERS", "HEADS", "EMBED", "SEQ", "BATCH", "VOCAB"),
                   help="one size of your own instead of --sizes")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-torch", action="store_true", help="the XLA column only")
    args = p.parse_args(argv)
    named = sizes()
    chosen = {"custom": tuple(args.size)} if args.size else {n: named[n] for n in args.sizes.split(",") if n}
    unknown = [n for n in chosen if n not in named and n != "custom"]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; choose from {sorted(named)}")
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            pass
    print(f"jax {jax.__version__}" + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else
                                       ", no torch") + f"; load average {os.getloadavg()[0]:.1f}")
    summary = []
    for name, size in chosen.items():
        r = floor(size, args.repeats, torch)
        cfg = r["cfg"]
        print(f"\n{name}: L={cfg.num_layers} H={cfg.num_heads} D={cfg.embed_dim} T={cfg.seq_len} B={r['batch']} "
              f"vocab={cfg.vocab_size}")
        print(f"{'einsum':<22} {'lhs':<18} {'rhs':<18} {'per step':>8} {'XLA ms':>7} {'GFLOP/s':>7} "
              f"{'torch ms':>8} {'GFLOP/s':>7}")
        for spec, lhs, rhs, count, xla, pt, flops in r["rows"]:
            print(f"{spec:<22} {str(lhs):<18} {str(rhs):<18} {count:>8} {xla:7.2f} {flops / xla / 1e6:7.0f} "
                  f"{pt:8.2f} {flops / pt / 1e6:7.0f}")
        t = r["total"]
        print(f"all matmuls of one step, each alone: XLA {t['xla']:.0f} ms, PyTorch {t['torch']:.0f} ms "
              f"(ratio {t['xla'] / t['torch']:.2f})")
        summary.append((name, r["step"], t["xla"], r["ratio"], *r["ratio_range"]))
    print(f"\n{'size':<8} {'step ms':>8} {'XLA matmuls ms':>15} {'step / matmuls':>15} {'range':>11}")
    for name, step, mm, ratio, lo, hi in summary:
        print(f"{name:<8} {step:8.1f} {mm:15.1f} {ratio:15.2f} {lo:5.2f}-{hi:.2f}")
    print("step / matmuls: the whole training step over the sum of its matmuls timed alone in XLA, per round "
          "(median and range over the rounds; goal <= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
