"""Per-device temporary memory of a compiled pipeline step, as the microbatch count grows.

The microbatch size is fixed (the batch grows with m), as when one raises m to
shrink the bubble. 1F1B keeps at most p stage inputs per stage, so its temporary
memory stays flat; GPipe keeps all m, so it grows linearly. Interleaved keeps
about `2(p-1) + (v-1)p + 1` chunk inputs, each of 1/v of a stage's layers.
ZB-H1 keeps 1F1B's p stage inputs, plus up to p-1 incoming gradients for its
deferred weight-gradient (W) ticks.

    python benchmarks/pipeline_memory.py                       # 8 CPU devices
    python benchmarks/pipeline_memory.py --microbatches 4 8 16 32

Numbers are `compiled.memory_analysis().temp_size_in_bytes` (XLA's CPU buffer
assignment; GPU/TPU assign differently but scale the same way). `slots` are the
executor's buffers (stage inputs kept for the backward, plus incoming gradients),
`slots MiB` their size; the rest of `temp` is the working set of one chunk's
recomputed forward and backward, the same for every m.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqgpt  # noqa: E402
from eqgpt import nn  # noqa: E402
from eqgpt.data import Batch  # noqa: E402
from eqgpt.parallel import make_mesh  # noqa: E402
from eqgpt.parallel.pipeline import lower, make_pipeline_schedule, pipeline_grad_fn  # noqa: E402


def temp_bytes(mesh, schedule, model, microbatch: int, seq: int) -> int:
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    shape = (schedule.num_microbatches * microbatch * d, seq)
    batch = Batch(jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.int32))
    return pipeline_grad_fn(mesh, schedule).temp_bytes(model, batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="pipeline=4,data=2")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "interleaved", "zb1"])
    ap.add_argument("--microbatch-size", type=int, default=8, help="rows per microbatch per data-parallel device")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()

    mesh = make_mesh(args.mesh)
    cfg = eqgpt.GPTConfig(vocab_size=256, seq_len=args.seq, num_layers=args.layers, num_heads=4,
                          embed_dim=args.width)
    model = eqx.filter_eval_shape(lambda k: nn.GPT(cfg, key=k), jax.random.key(0))
    act = args.microbatch_size * args.seq * args.width * 4
    print(f"mesh {args.mesh}; {args.layers} layers of width {args.width}, seq {args.seq}; "
          f"one stage input = {act / 2**10:.0f} KiB per device")
    print(f"{'schedule':<12}{'m':>4}{'bubble':>8}{'slots':>7}{'slots MiB':>11}{'temp MiB':>10}{'vs first':>10}")
    for name in args.schedules:
        first = None
        for m in args.microbatches:
            sched = make_pipeline_schedule(name, mesh.shape["pipeline"], m, 2)
            t = temp_bytes(mesh, sched, model, args.microbatch_size, args.seq)
            first = first or t
            low = lower(sched)
            slots = low.act_slots + low.grad_slots  # stage inputs + incoming gradients
            print(f"{name:<12}{m:>4}{sched.bubble:>8.3f}{slots:>7}{slots * act / 2**20:>11.2f}"
                  f"{t / 2**20:>10.2f}{t / first:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
