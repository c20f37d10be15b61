"""The recipe's model initialiser, compiled for a TPU that need not be there: XLA compile seconds per preset.

`eqgpt-train` creates the model with one jitted call of `make_model` (`Strategy.init_model`:
`GPT(config, key)` cast to the precision policy's parameter dtype) before it compiles the step,
so that compile sits on a cold start's critical path (`docs/profiling_results.md`, "Cold and warm
starts"). This compiles the same function, for one device of `--topology` (libtpu's compile-only
devices on a CPU host, or the first real device with `--topology ""`), in this process, and prints
the seconds of `lower` and of XLA's compile for each preset:

    python benchmarks/init_compile.py --presets gpt2-small,llama-1b,gpt2-small-moe --topology v5e:1x1
"""

from __future__ import annotations

import argparse
import sys
import time

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import eqgpt
from eqgpt.nn import GPT
from eqgpt.precision import Policy


def device(topology: str):
    """One device: the first of a compile-only TPU `topology` ('v5e:1x1'), or this machine's first."""
    if not topology:
        return jax.devices()[0]
    from jax.experimental import topologies

    bounds = {"chips_per_host_bounds": (1, 1, 1)} if topology.endswith(":1x1") else {}
    return topologies.get_topology_desc(topology_name=topology, platform="tpu", **bounds).devices[0]


def init_seconds(preset: str, dev, precision: str) -> tuple[float, float]:
    """(lower, compile) seconds of the recipe's initialiser for `preset` on `dev`."""
    cfg, policy = eqgpt.preset(preset), Policy.named(precision)
    sharding = NamedSharding(Mesh(np.array([dev]), ("data",)), PartitionSpec())
    make = lambda key: policy.cast_to_param(GPT(cfg, key=key))  # noqa: E731 (the recipe's make_model)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
    t0 = time.perf_counter()
    lowered = jax.jit(make, out_shardings=sharding).lower(key)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="gpt2-small,llama-1b,gpt2-small-moe")
    parser.add_argument("--topology", default="v5e:1x1", help="libtpu topology; '' for this machine's device")
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args(argv)
    dev = device(args.topology)
    print(f"the recipe's initialiser on {dev.device_kind} ({args.topology or 'this machine'}), jax {jax.__version__}, "
          f"--precision {args.precision}")
    print(f"{'preset':<16} {'params':>9} {'lower s':>8} {'compile s':>10}")
    for name in args.presets.split(","):
        lower, compile_ = init_seconds(name, dev, args.precision)
        params = sum(x.size for x in jax.tree.leaves(eqx.filter_eval_shape(GPT, eqgpt.preset(name),
                                                                           key=jax.random.key(0))))
        print(f"{name:<16} {params / 1e6:>8.1f}M {lower:>8.2f} {compile_:>10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
