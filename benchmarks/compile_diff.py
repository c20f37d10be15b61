"""Why does the recipe's training step compile slower than `compile_time.py --layer-choices`'s?

Both compile one chip's bf16 step for the same model and batch; they differ in how the step is
built. Each variant below starts from the benchmark's step and takes one of the recipe's
choices (or all of them), and compiles in a fresh process. Printed: trace+lower seconds, the
XLA compile's wall seconds and the process's CPU seconds during it (every thread), and whether
the attention is the TPU kernel (`tpu_custom_call` in the HLO); on a real device also the wall
seconds to create the initial state (its initialiser's compile included). `--copies N` compiles N
copies of the step at once in threads of one process, as the recipe compiles its programs side
by side: on a host with few cores (this one's TPU compile runs one thread) that is what shows
threads contending for the allocator.

- `opt`: `plain` (`make_optimizer(make_lr_schedule(...))`, the benchmark's) or `recipe`
  (`eqgpt.cli.train.optimizer_of` of the recipe's default flags).
- `strategy`: `none` (`make_train_step`'s default) or `single` (`ParallelFlags().strategy()`,
  what `strategy_of` gives the recipe on one device) or `mesh1` (a one-device mesh, as eqgpt-plan).
- `model_like`: whether `make_train_step` gets the model's shapes.
- `state`: `bench` (the benchmark's `TrainState`) or `recipe` (`eqgpt.train.initial_state`).
- the process: `malloc`, its `GLIBC_TUNABLES`: glibc's defaults, `eqgpt` (the settings
  `eqgpt-train` restarts with where its steps run on the CPU, `eqgpt.launch.GLIBC_MALLOC_TUNABLES`;
  before issue 47 it did so on a TPU too) or `no-arena` (those but `arena_max=1`); `cache`:
  JAX's persistent compilation cache on, in an empty directory, as the recipe has it.

`recipe` is the recipe's step in the benchmark's process, `recipe+env` in the recipe's process
as it was on the v5e (malloc settings and cache), `plan` as `eqgpt-plan` builds it (a one-device
mesh). On a real accelerator the state and batch are placed arrays (`step.lower(state, batch)`);
with `--topology v5e:1x1` they are shapes on libtpu's compile-only devices (on a CPU host; the
Pallas attention lowers for the TPU there, which needs a GPT-2-sized head: gpt2 presets only).

    python benchmarks/compile_diff.py --layers 3 --topology v5e:1x1        # CPU host
    python benchmarks/compile_diff.py --layers 1 --topology v5e:1x1 --copies 2 --variants bench,+malloc
    python benchmarks/compile_diff.py --variants bench,+malloc,recipe       # on the v5e, 12 layers
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from eqgpt.launch import GLIBC_MALLOC_TUNABLES


class Variant(NamedTuple):
    """How a step is built (the benchmark's choice first) and the process it compiles in."""

    opt: str = "plain"  # or "recipe"
    strategy: str = "none"  # or "single", "mesh1"
    model_like: bool = False
    state: str = "bench"  # or "recipe"
    malloc: str = "default"  # GLIBC_TUNABLES: glibc's defaults, "eqgpt" (eqgpt-train's on a CPU), "no-arena"
    cache: bool = False  # JAX's persistent compilation cache on (an empty directory), as the recipe has it


RECIPE = dict(opt="recipe", strategy="single", model_like=True, state="recipe")
VARIANTS = {
    "bench": Variant(),
    "+opt": Variant(opt="recipe"),
    "+strategy": Variant(strategy="single"),
    "+model_like": Variant(model_like=True),
    "+state": Variant(state="recipe"),
    "+malloc": Variant(malloc="eqgpt"),
    "+malloc-arena": Variant(malloc="no-arena"),
    "+cache": Variant(cache=True),
    "recipe": Variant(**RECIPE),
    "recipe+env": Variant(**RECIPE, malloc="eqgpt", cache=True),
    "plan": Variant(**{**RECIPE, "strategy": "mesh1"}),
}

MALLOC = {"default": "", "eqgpt": GLIBC_MALLOC_TUNABLES,
          "no-arena": GLIBC_MALLOC_TUNABLES.replace(":glibc.malloc.arena_max=1", "")}
"""Variant.malloc -> GLIBC_TUNABLES ("" is glibc's defaults)."""


def run_variant(name: str, preset: str, layers: int, batch: int, topology: str | None, copies: int = 1) -> dict:
    """Compile variant `name`'s step (`copies` of it at once, in threads) in this process (JAX not yet
    initialised); **returns** its figures."""
    import equinox as eqx
    import jax
    import numpy as np

    import eqgpt
    from eqgpt.cli.train import TrainConfig, optimizer_of
    from eqgpt.data import Batch
    from eqgpt.nn import GPT
    from eqgpt.nn.kernels.platform import compiling_for
    from eqgpt.parallel import ParallelFlags, Strategy
    from eqgpt.parallel.mesh import make_mesh
    from eqgpt.train import Policy, TrainState, make_lr_schedule, make_optimizer, make_train_step
    from eqgpt.train.state import initial_state
    from eqgpt.train.step import lower_from_shapes

    v = VARIANTS[name]
    opt, strat, give_like, state_kind = v.opt, v.strategy, v.model_like, v.state
    if v.cache:  # as eqgpt.compile_cache.enable_compile_cache sets it, in an empty directory
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="compile_diff_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if topology:
        from jax.experimental import topologies

        device = topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
    else:
        device = jax.devices()[0]
    platform = device.platform
    with compiling_for(platform):  # the target's kernels (and `auto`'s choice) on a compile-only host
        config = eqgpt.preset(preset, num_layers=layers or None, scan_layers=False)
        policy = Policy.named("bf16")
        if opt == "plain":
            optimizer = policy.optimizer(make_optimizer(make_lr_schedule(1e-4, total_steps=1000, warmup_steps=10)))
        else:
            optimizer, _ = optimizer_of(TrainConfig(precision="bf16", steps=30), policy)
        strategy = {"none": None, "single": ParallelFlags().strategy(),
                    "mesh1": Strategy(make_mesh("data=-1", [device]), "dp")}[strat]
        make_model = lambda k: policy.cast_to_param(GPT(config, key=k))  # noqa: E731
        model_like = jax.eval_shape(make_model, jax.random.key(0))
        if state_kind == "bench":
            make_state = lambda k: TrainState(*(lambda m: (m, optimizer.init(eqx.filter(m, eqx.is_array))))(  # noqa: E731
                make_model(k)), rng=k, loss_scale=policy.loss_scale_state())
        else:
            make_state = lambda k: initial_state(optimizer, strategy or Strategy(), policy, make_model, 0)  # noqa: E731
        windows = np.zeros((batch, config.seq_len + 1), np.int32)
        step = make_train_step(optimizer, strategy=strategy, policy=policy,
                               model_like=model_like if give_like else None)
        t0, init = time.perf_counter(), None
        if topology:
            sharding = jax.sharding.SingleDeviceSharding(device)
            place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
            leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
            state = jax.tree.map(place, eqx.filter_eval_shape(make_state, jax.random.key(0)), is_leaf=leaf)
            batch_in = jax.tree.map(place, jax.eval_shape(Batch.from_windows, windows), is_leaf=leaf)
            with jax.default_device(device):  # Pallas's Mosaic lowering reads the TPU's kind from it
                lowered = [lower_from_shapes(step, state, batch_in) for _ in range(copies)]
        else:
            t_state = time.perf_counter()
            state = make_state(jax.random.key(0)) if state_kind == "recipe" else eqx.filter_jit(make_state)(
                jax.random.key(0))
            jax.block_until_ready(state)
            init = time.perf_counter() - t_state
            batch_in = (strategy or Strategy()).batch(Batch.from_windows(windows))
            t0 = time.perf_counter()
            # the step's own lowering; more copies as lower_from_shapes lowers it (a fresh jit each: compiled anew)
            lowered = [step.lower(state, batch_in)] + [lower_from_shapes(step, state, batch_in)
                                                       for _ in range(copies - 1)]
    t_lower, cpu0 = time.perf_counter(), time.process_time()
    with concurrent.futures.ThreadPoolExecutor(copies) as pool:  # side by side, as the recipe compiles
        compiled = list(pool.map(lambda low: low.compile(), lowered))
    t_compile, cpu = time.perf_counter(), time.process_time() - cpu0
    del compiled
    hlo = getattr(lowered[0], "lowered", lowered[0]).as_text()  # equinox's Lowered wraps JAX's
    return {"malloc": os.environ.get("GLIBC_TUNABLES", ""), "init": init, "lower": t_lower - t0,
            "compile": t_compile - t_lower, "compile_cpu": cpu,
            "tpu_kernel": "tpu_custom_call" in hlo, "platform": f"compile-only {topology}" if topology else platform}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), type=lambda v: v.split(","),
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--layers", type=int, default=0, help="unrolled layers (default: the preset's)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--topology", default=None, help="compile for this TPU on a CPU host, e.g. v5e:1x1")
    p.add_argument("--copies", type=int, default=1, help="compile this many copies of the step at once, in "
                   "threads of one process (the recipe compiles its programs side by side)")
    p.add_argument("--run-variant", default=None, help=argparse.SUPPRESS)  # internal: one variant here
    args = p.parse_args(argv)
    if args.run_variant:
        print(json.dumps(run_variant(args.run_variant, args.preset, args.layers, args.batch, args.topology,
                                     args.copies)))
        return 0
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    copies = f"{args.copies} copies at once" if args.copies > 1 else "a cold compile"
    print(f"{args.preset}, {args.layers or 'all'} layers unrolled, batch {args.batch}, bf16: the training step, "
          f"{copies} per variant in a fresh process (load average {os.getloadavg()[0]:.1f})")
    print(f"{'variant':<14} {'opt':<7} {'strategy':<8} {'like':<5} {'state':<7} {'malloc':<9} {'cache':<5} "
          f"{'init s':>6} {'lower s':>8} {'compile s':>9} "
          f"{'compile CPU s':>13}  kernel")
    for name in args.variants:
        cmd = [sys.executable, __file__, "--run-variant", name, "--preset", args.preset, "--layers", str(args.layers),
               "--batch", str(args.batch), "--copies", str(args.copies)]
        cmd += ["--topology", args.topology] if args.topology else []
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
        env["EQGPT_NO_COMPILE_CACHE"] = "1"  # a cold compile (+cache: into an empty directory)
        env["GLIBC_TUNABLES"] = MALLOC[VARIANTS[name].malloc]
        if args.topology:
            env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise RuntimeError(f"{name} failed:\n{out.stdout}{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        v = VARIANTS[name]
        init = "-" if r["init"] is None else f"{r['init']:.1f}"
        if r["malloc"] != MALLOC[v.malloc]:
            raise RuntimeError(f"{name} ran with GLIBC_TUNABLES={r['malloc']!r}, not {MALLOC[v.malloc]!r}")
        print(f"{name:<14} {v.opt:<7} {v.strategy:<8} {str(v.model_like):<5} {v.state:<7} {v.malloc:<9} "
              f"{'on' if v.cache else 'off':<5} {init:>6} {r['lower']:8.1f} {r['compile']:9.1f} "
              f"{r['compile_cpu']:13.1f}  {'tpu_custom_call' if r['tpu_kernel'] else 'no Pallas call'} "
              f"({r['platform']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
