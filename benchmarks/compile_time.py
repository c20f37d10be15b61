"""Time to the first training step: model construction, initialisation, and the step's
trace, lowering and XLA compile (`jax.stages`), per strategy and depth.

Each case runs in a fresh process (a cold start, as a user's), the way
`recipes/train_gpt.py` starts: the model's shapes under `jax.eval_shape`, the model
and optimizer state created directly in their shardings, then the step lowered and
compiled. "ready" is the wall time from the first JAX call to a compiled step
(imports excluded, the step not run). The step's trace and lowering are split with
`jax.monitoring`'s lowering event (`trace = lower() wall - jaxpr-to-MLIR time`).

Cases: gpt2-small (vocabulary padded to 50304) on 1 device and on 8 simulated CPU
devices with fsdp+tp, pipeline 1F1B and context ring, layers scanned as the recipe
runs 12 of them; and 12 or 48 layers, scanned or unrolled, on 1 device. `--unrolled`
unrolls every case (how the recipe ran gpt2-small before it scanned deep models).

With `--cache DIR` every case runs twice, each time in a new process, with JAX's
persistent compilation cache in DIR (emptied first) set as the recipe sets it:
"cold" fills it, "warm" is a second start that reads it.

Run: `python benchmarks/compile_time.py [--cases fsdp+tp ...] [--cache /tmp/xla-cache]`
(`--list` names the cases; `--preset nano --layers 2` for a quick check).

**Scan or unroll** (`--layer-choices scan,scan2,scan4,unrolled`): the training step of one
chip (bf16, the recipe's policy) with its layers scanned (`GPTConfig.scan_unroll` 1, 2 or 4
layers per iteration) or unrolled, each in a fresh process: trace and lower, XLA compile,
and on a real accelerator the median step time. `--topology v5e:1x1` compiles for a TPU
that is not there (libtpu's compile-only devices, on a CPU host): compile times, no steps.

    python benchmarks/compile_time.py --layer-choices scan,scan2,scan4,unrolled --topology v5e:1x1
    python benchmarks/compile_time.py --layer-choices scan,scan2,scan4,unrolled --batch 16   # on the v5e
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import NamedTuple


class Case(NamedTuple):
    """One start: a model preset and depth, a mesh and strategy (recipe flag syntax)."""

    devices: int = 1
    mesh: str = ""
    rules: str = "dp"
    pipeline: str | None = None
    context: str | None = None
    layers: int = 12
    scan: bool = True


# The strategies at gpt2-small's 12 layers, scanned as recipes/train_gpt.py runs them (it unrolls
# models of up to 8 layers; --unrolled runs them as it ran gpt2-small before). "1 device" is also
# the 12-layer scanned row of the depth comparison.
CASES = {
    "1 device": Case(),
    "fsdp+tp": Case(8, "fsdp=4,tensor=2", "fsdp+tp"),
    "pipeline 1f1b": Case(8, "pipeline=2,data=2,tensor=2", "dp+tp", pipeline="1f1b"),
    "context ring": Case(8, "context=2,fsdp=2,tensor=2", "fsdp+tp", context="ring"),
    "12 unrolled": Case(layers=12, scan=False),
    "48 scanned": Case(layers=48, scan=True),
    "48 unrolled": Case(layers=48, scan=False),
}


def run_case(case: Case, preset: str, batch: int, seq: int | None, vocab: int | None, layers: int | None) -> dict:
    """Start `case` in this process (JAX not yet initialised); **returns** seconds per phase."""
    import jax

    jax.config.update("jax_num_cpu_devices", case.devices)
    durations: dict[str, float] = {}
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: durations.__setitem__(event, durations.get(event, 0.0) + secs))
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))

    import numpy as np

    import eqgpt
    from eqgpt.data import Batch
    from eqgpt.nn import GPT
    from eqgpt.parallel import ParallelFlags
    from eqgpt.train import TrainState, make_lr_schedule, make_optimizer, make_train_step

    t0 = time.perf_counter()
    overrides = {k: v for k, v in (("seq_len", seq), ("vocab_size", vocab)) if v}
    config = eqgpt.preset(preset, num_layers=layers or case.layers, scan_layers=case.scan, **overrides)
    strategy = ParallelFlags.parse(case.mesh, case.rules, pipeline=case.pipeline, context=case.context)
    make_model = lambda k: GPT(config, key=k)  # noqa: E731
    model_like = jax.eval_shape(make_model, jax.random.key(0))
    strategy.check(model_like, batch_size=batch, seq_len=config.seq_len)
    t_construct = time.perf_counter()
    optimizer = make_optimizer(make_lr_schedule(1e-3, total_steps=100, warmup_steps=10))
    model = strategy.init_model(make_model, jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    jax.block_until_ready(state)
    windows = np.zeros((batch, config.seq_len + 1), np.int32)
    batch_arrays = strategy.batch(Batch.from_windows(windows))
    t_init = time.perf_counter()
    step = make_train_step(optimizer, strategy=strategy, model_like=model_like)
    before = dict(durations)
    lowered = step.lower(state, batch_arrays)
    t_lower = time.perf_counter()
    events.clear()
    lowered.compile()
    t_compile = time.perf_counter()
    mlir = durations.get("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.0) - before.get(
        "/jax/core/compile/jaxpr_to_mlir_module_duration", 0.0)
    return {
        "construct": t_construct - t0, "init": t_init - t_construct,
        "trace": t_lower - t_init - mlir, "lower": mlir, "compile": t_compile - t_lower, "ready": t_compile - t0,
        "cached": "/jax/compilation_cache/cache_hits" in events,
    }


LAYER_CHOICES = {"scan": (True, 1), "scan2": (True, 2), "scan3": (True, 3), "scan4": (True, 4),
                 "unrolled": (False, 1)}
"""Choice name -> (GPTConfig.scan_layers, scan_unroll)."""


def run_choice(choice: str, preset: str, batch: int, topology: str | None, kernel: str, steps: int) -> dict:
    """Compile one chip's bf16 training step with the layers as `choice` says (JAX not yet
    initialised); on a real device also time `steps` steps. **Returns** seconds per phase."""
    import jax

    durations: dict[str, float] = {}
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: durations.__setitem__(event, durations.get(event, 0.0) + secs))
    import equinox as eqx
    import numpy as np

    import eqgpt
    from eqgpt.data import Batch
    from eqgpt.nn import GPT
    from eqgpt.train import Policy, TrainState, make_lr_schedule, make_optimizer, make_train_step

    scan, unroll = LAYER_CHOICES[choice]
    config = eqgpt.preset(preset, scan_layers=scan, scan_unroll=unroll, attention_kernel=kernel)
    policy = Policy.named("bf16")
    optimizer = policy.optimizer(make_optimizer(make_lr_schedule(1e-4, total_steps=1000, warmup_steps=10)))
    make_state = lambda k: TrainState(*(lambda m: (m, optimizer.init(eqx.filter(m, eqx.is_array))))(  # noqa: E731
        policy.cast_to_param(GPT(config, key=k))), rng=k, loss_scale=policy.loss_scale_state())
    windows = np.zeros((batch, config.seq_len + 1), np.int32)
    step = make_train_step(optimizer, policy=policy)
    t0 = time.perf_counter()
    if topology:  # compile-only devices: abstract arguments, the step's function under jax.jit
        from jax.experimental import topologies

        device = topologies.get_topology_desc(topology, "tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))  # noqa: E731
        abstract = jax.eval_shape(make_state, jax.random.key(0))
        dynamic, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
        inner = step.__wrapped__
        fn = jax.jit(lambda d, b: eqx.filter(inner(eqx.combine(d, static), b), eqx.is_array), donate_argnums=0)
        lowered = fn.lower(jax.tree.map(place, dynamic), jax.tree.map(place, Batch.from_windows(windows)))
        state = batch_arrays = None
    else:
        state = eqx.filter_jit(make_state)(jax.random.key(0))
        batch_arrays = jax.device_put(Batch.from_windows(windows))
        t0 = time.perf_counter()
        lowered = step.lower(state, batch_arrays)
    t_lower, cpu_lower = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t_compile, cpu_compile = time.perf_counter(), time.process_time() - cpu_lower
    step_ms = None
    if state is not None and steps:
        times = []
        for _ in range(steps + 2):  # two warm-up steps
            start = time.perf_counter()
            state, metrics = compiled(state, batch_arrays)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        step_ms = 1e3 * float(np.median(times[2:]))
    return {"lower": t_lower - t0, "compile": t_compile - t_lower, "compile_cpu": cpu_compile, "step_ms": step_ms,
            "platform": "compile-only " + topology if topology else jax.devices()[0].platform}


def compare_layers(args) -> int:
    """The scan-or-unroll table: one fresh process per choice."""
    unknown = [c for c in args.layer_choices if c not in LAYER_CHOICES]
    if unknown:
        raise ValueError(f"--layer-choices: unknown {unknown}; choose from {list(LAYER_CHOICES)}")
    kernel = args.kernel or ("splash" if args.topology else "auto")
    on = f"compile-only {args.topology}" if args.topology else "the first device"
    print(f"{args.preset}, batch {args.batch}, bf16, attention {kernel}, on {on}: one chip's training step, "
          "a cold compile per choice")
    print(f"{'layers':<10} {'trace+lower s':>13} {'compile s':>9} {'compile CPU s':>13} {'step ms':>8}")
    for choice in args.layer_choices:
        cmd = [sys.executable, __file__, "--run-choice", choice, "--preset", args.preset, "--batch", str(args.batch),
               "--kernel", kernel, "--time-steps", str(args.time_steps)]
        cmd += ["--topology", args.topology] if args.topology else []
        env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # no cache: a cold compile
        if args.topology:  # JAX on the CPU; libtpu only compiles (and may be loaded by other processes)
            env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise RuntimeError(f"{choice} failed:\n{out.stdout}{out.stderr[-4000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        step = f"{r['step_ms']:8.1f}" if r["step_ms"] is not None else f"{'-':>8}"
        print(f"{choice:<10} {r['lower']:13.1f} {r['compile']:9.1f} {r['compile_cpu']:13.1f} {step}  "
              f"({r['platform']})", flush=True)
    print("scan: one lax.scan iteration per layer; scanN: N layers per iteration (GPTConfig.scan_unroll); "
          "unrolled: every layer in the program; compile CPU: the process's CPU seconds during the compile (every "
          "thread; what a loaded machine's wall clock hides); step: median of --time-steps after two warm-up steps")
    return 0


def start(name: str, args, cache: str | None) -> dict:
    """Run one case in a new process; **returns** its phases."""
    cmd = [sys.executable, __file__, "--run", name, "--preset", args.preset, "--batch", str(args.batch)]
    cmd += ["--seq", str(args.seq)] if args.seq else []
    cmd += ["--vocab", str(args.vocab)] if args.vocab else []
    cmd += ["--layers", str(args.layers)] if args.layers else []
    cmd += ["--unrolled"] if args.unrolled else []
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    if cache:  # as recipes/train_gpt.py sets it: every program, a bounded (file-locked) cache
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_COMPILATION_CACHE_MAX_SIZE=str(4 << 30))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{name} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=list(CASES), help="case names (default: all)")
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--vocab", type=int, default=50304,
                   help="vocabulary (default 50304: GPT-2's 50257 padded to a multiple of 64, which tensor=2 divides)")
    p.add_argument("--layers", type=int, default=None, help="override every case's depth")
    p.add_argument("--unrolled", action="store_true", help="unroll every case's layers")
    p.add_argument("--cache", default=None, help="persistent compilation cache directory: cold start, then warm")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    p.add_argument("--layer-choices", default=None, type=lambda v: v.split(","),
                   help=f"scan or unroll: compare these ({', '.join(LAYER_CHOICES)}), comma-separated")
    p.add_argument("--topology", default=None, help="with --layer-choices: compile for this TPU, e.g. v5e:1x1 "
                   "(libtpu's compile-only devices; no steps)")
    p.add_argument("--kernel", default=None, help="with --layer-choices: attention kernel (default: splash with "
                   "--topology, else auto)")
    p.add_argument("--time-steps", type=int, default=10, help="with --layer-choices: steps timed on a real device")
    p.add_argument("--run-choice", default=None, help=argparse.SUPPRESS)  # internal: one layer choice
    args = p.parse_args(argv)
    if args.run_choice:
        print(json.dumps(run_choice(args.run_choice, args.preset, args.batch, args.topology, args.kernel,
                                    args.time_steps)))
        return 0
    if args.layer_choices:
        return compare_layers(args)
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.run:
        case = CASES[args.run]._replace(scan=False) if args.unrolled else CASES[args.run]
        print(json.dumps(run_case(case, args.preset, args.batch, args.seq, args.vocab, args.layers)))
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES)}")

    print(f"{args.preset}, vocab {args.vocab}, batch {args.batch}{f', seq {args.seq}' if args.seq else ''}: "
          "seconds from the first JAX "
          f"call to a compiled step (load average {os.getloadavg()[0]:.1f})")
    head = (f"{'case':<16} {'layers':>6} {'construct':>9} {'init':>6} {'trace':>6} {'lower':>6} {'compile':>7} "
            f"{'ready':>6}")
    print(head + ("  start  step" if args.cache else ""))
    for name in args.cases:
        case = CASES[name]._replace(scan=False) if args.unrolled else CASES[name]
        if args.cache:
            shutil.rmtree(args.cache, ignore_errors=True)
        for when in ("cold", "warm") if args.cache else ("",):
            r = start(name, args, args.cache)
            layers = f"{args.layers or case.layers}{'s' if case.scan else 'u'}"
            source = f"  {when:<5}  {'cached' if r['cached'] else 'compiled'}" if args.cache else ""
            print(f"{name:<16} {layers:>6} {r['construct']:9.2f} {r['init']:6.2f} {r['trace']:6.2f} {r['lower']:6.2f} "
                  f"{r['compile']:7.2f} {r['ready']:6.2f}{source}", flush=True)
    print("layers: s scanned (one lax.scan), u unrolled; construct: shapes under eval_shape and the strategy's checks; "
          "init: model and optimizer state created in their shardings (compile and run); compile: the step's XLA "
          "compile, or its read from the cache on a warm start; step: whether the compile was a persistent-cache hit "
          "(JAX's cache-hit event)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
