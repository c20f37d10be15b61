"""eqgpt's int8 matmul against Qwix's, forward + backward: compile seconds and run time.

One `[M, K] x [K, N]` matmul differentiated: `jnp.matmul` (float), `eqgpt.nn.quant.int8_matmul`
with the `qat` and `qt` backwards, and Qwix's `dot_general_qt` with int8 forward only and with
int8 gradients too. Run times are the minimum of `--repeats` interleaved runs, so load from
other processes hits every row alike. Qwix is not a dependency of eqgpt (it imports Flax):

    pip install qwix flax && python benchmarks/int8_vs_qwix.py

Without Qwix it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from eqgpt.nn.quant import int8_matmul

DN = (((1,), (0,)), ((), ()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="2048,768,3072", help="M,K,N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    try:  # Qwix's differentiable quantized dot; `qwix.dot_general` takes arrays already quantized.
        from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt
    except ImportError as e:
        print(f"Qwix is not installed ({e}); pip install qwix flax to compare.")
        return 0
    m, k, n = map(int, args.shape.split(","))
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(jax.random.key(0), (m, k), dtype)
    w = (jax.random.normal(jax.random.key(1), (k, n)) * 0.02).astype(dtype)
    i8 = jnp.int8
    impls = {
        "float (jnp.matmul)": lambda a, b: a @ b,
        "eqgpt int8_matmul qat": lambda a, b: int8_matmul(a, b, "qat"),
        "eqgpt int8_matmul qt": lambda a, b: int8_matmul(a, b, "qt"),
        "qwix dot_general_qt, int8 forward": lambda a, b: dot_general_qt(
            a, b, DN, DotGeneralQtConfig(lhs_qtype=i8, rhs_qtype=i8)),
        "qwix dot_general_qt, int8 forward + gradients": lambda a, b: dot_general_qt(
            a, b, DN, DotGeneralQtConfig(lhs_qtype=i8, rhs_qtype=i8, dlhs_grad_qtype=i8, drhs_grad_qtype=i8)),
    }
    compiled, compile_s = {}, {}
    for name, f in impls.items():
        grad = jax.jit(jax.grad(lambda a, b, f=f: jnp.sum(f(a, b).astype(jnp.float32) ** 2), argnums=(0, 1)))
        t = time.perf_counter()
        compiled[name] = grad.lower(x, w).compile()
        compile_s[name] = time.perf_counter() - t
        jax.block_until_ready(compiled[name](x, w))
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(args.repeats):
        for name, c in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(c(x, w))
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"[{m}, {k}] x [{k}, {n}] {args.dtype}, forward + backward; {jax.devices()[0].device_kind}; "
          f"jax {jax.__version__}")
    print("| matmul | compile | run (min of interleaved) |\n| --- | ---: | ---: |")
    for name in impls:
        print(f"| {name} | {compile_s[name]:.2f} s | {best[name] * 1e3:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
