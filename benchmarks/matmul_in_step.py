"""A dense layer's matmuls as training runs them, against the planner's calibration (forward-only pairs).

The planner (`eqgpt.plan.model`) prices every matmul of a step at the efficiency of
`benchmarks/plan_calibration.py`'s chain `[m,k]@[k,n]` then `[m,n]@[n,k]`. A training step
runs each weight's matmul three ways: the forward `y = x @ w`, the input gradient
`dx = dy @ w.T` and the weight gradient `dw = x.T @ dy` (contracting over the m rows), and
fuses elementwise work (an activation and its derivative) into them. This times, at steady
state like the calibration (`(time of 2N loop iterations - time of N) / N`):

- `pair`: the calibration's chain, 4mkn FLOPs an iteration;
- `fwd+bwd`: `jax.vjp` of `x @ w`, cotangent `y`: forward, input and weight gradient, 6mkn;
- `gelu fwd+bwd`: the same through `gelu(x @ w)` (its derivative fused into the backward), 6mkn.

Each iteration's `x` is the previous one's input gradient (with `w ~ N(0, 1/n)`, `w @ w.T`
keeps its scale) and the weight gradients are summed into a carry, so nothing is hoisted or dropped; the
compiled body's matmul FLOPs are checked. Prints efficiency = FLOPs / (time x peak):

    python benchmarks/matmul_in_step.py            # on a TPU v5e
    python benchmarks/matmul_in_step.py --quick    # small shapes, a CPU check
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from eqgpt.profile import matmul_flops

# (m, k, n): gpt2-small at 16 x 1024 tokens (MLP in and out, the LM head), llama-1b at 5 x 2048 (MLP, attention)
SHAPES = ((16384, 768, 3072), (16384, 3072, 768), (16384, 768, 50257),
          (10240, 2048, 5632), (10240, 5632, 2048), (10240, 2048, 2048))
QUICK = ((64, 128, 256),)
UNROLL = 4


def _calibration():
    """`benchmarks/plan_calibration.py` as a module (its steady-state timer and chip catalogue)."""
    name = "plan_calibration"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def bodies() -> dict:
    """name -> (body(x, w, g) -> (x, g) running UNROLL units, matmul FLOPs of one unit / mkn)."""
    barrier = jax.lax.optimization_barrier

    def pair(x, w, g):
        for _ in range(UNROLL):
            x = barrier(barrier(x @ w) @ w.T)
        return x, g

    def through(f):
        def body(x, w, g):
            for _ in range(UNROLL):
                y, vjp = jax.vjp(f, x, w)
                dx, dw = vjp(y)
                x, g = barrier((dx, g + dw))  # every unit's weight gradient is used
            return x, g
        return body

    return {"pair": (pair, 4), "fwd+bwd": (through(lambda x, w: x @ w), 6),
            "gelu fwd+bwd": (through(lambda x, w: jax.nn.gelu(x @ w)), 6)}


def rows(shapes, dtype, peak, repeats, target_s) -> list[dict]:
    steady = _calibration().steady_seconds
    out = []
    for m, k, n in shapes:
        kx, kw = jax.random.split(jax.random.key(m + k + n))
        x = jax.random.normal(kx, (m, k), dtype)
        w = (jax.random.normal(kw, (k, n), jnp.float32) / n**0.5).astype(dtype)
        g = jnp.zeros((k, n), dtype)
        for name, (body, units) in bodies().items():
            counted = matmul_flops(jax.jit(body).lower(x, w, g).compile())
            expected = UNROLL * units * m * k * n
            if abs(counted - expected) > 0.01 * expected:
                raise RuntimeError(f"{name} [{m},{k}]x[{k},{n}]: the compiled body has {counted:.4g} matmul FLOPs, "
                                   f"not {expected:.4g}")
            loop = jax.jit(lambda i, x, w, g, body=body: jax.lax.fori_loop(
                0, i, lambda _, c: body(c[0], w, c[1]), (x, g)))
            seconds, iters = steady(loop, x, w, g, repeats=repeats, target_s=target_s)
            out.append({"m": m, "k": k, "n": n, "what": name, "ms": 1e3 * seconds / UNROLL, "iterations": iters,
                        "efficiency": expected / seconds / peak})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU check of the script)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=40.0)
    args = parser.parse_args(argv)
    cal = _calibration()
    device = jax.devices()[0]
    chip = cal.chip_name(device)
    if chip is not None:
        dtype, peak, source = jnp.bfloat16, cal.CHIPS[chip].peak_flops, f"catalogue ({chip})"
    else:
        dtype, (peak, source) = jnp.float32, cal.peak_flops(device)
    table = rows(QUICK if args.quick else SHAPES, dtype, peak, args.repeats, args.target_ms / 1e3)
    print(f"a dense layer's matmuls on {device.device_kind}; jax {jax.__version__}; peak {peak:.3g} FLOP/s ({source}); "
          f"{jnp.dtype(dtype).name}; ms per unit (a pair, or one forward and backward), steady state")
    print(f"{'m':>7} {'k':>6} {'n':>6}  {'what':<14} {'ms':>9} {'N':>5} {'eff':>6}")
    for r in table:
        print(f"{r['m']:>7} {r['k']:>6} {r['n']:>6}  {r['what']:<14} {r['ms']:>9.4f} {r['iterations']:>5} "
              f"{r['efficiency']:>6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
