"""The planner's calibration table (`eqgpt.plan.calibration`), measured on this machine's first device.

Three classes of operation, each timed alone at steady state, never a whole model:

- matmuls by shape (the widths of GPT-2 to Llama 3 8B, the rows of a device's tokens): a pair
  `[m, k] @ [k, n]` then `[m, n] @ [n, k]` (equal FLOPs), each feeding the next behind an
  optimization barrier, so XLA can neither hoist, merge nor reassociate them; efficiency =
  4mkn / (time x peak), given to both shapes;
- the attention kernel (forward + backward, causal; `flash` on TPU, `blockwise` elsewhere) by
  sequence length at 16k tokens per call, the next call's queries made to depend on this
  call's gradients (one element: no extra pass over memory); efficiency = eqgpt's attention
  FLOPs (`6 T D` per token, `eqgpt.profile.flops`) / (time x peak);
- memory-bound work: `x <- a * x + b` over a large array, bytes moved / time over the chip's
  HBM bandwidth (`eqgpt.plan.slices.CHIPS`).

**Steady state.** Each class runs as a `lax.fori_loop` inside one jitted program whose trip
count is an argument (one compile). A row's time per iteration is the difference between
`2N` and `N` iterations divided by `N` (medians of `--repeats` calls each): the fixed cost of
a call (dispatch, launch, the host's wait) cancels, nothing is subtracted by hand. `N` is
doubled until `N` iterations take about `--target-ms`. The compiler's matmul FLOPs of each
loop body (`eqgpt.profile.matmul_flops`) are checked against `4mkn` per pair.

Prints the table and writes the JSON the planner reads, with the command and the output it
came from. On a TPU v5e (what the lead runs; about 3 minutes):

    python benchmarks/plan_calibration.py --out src/eqgpt/plan/calibration/v5e.json

On CPU (`--quick`: small shapes, to check the script) the peak is a measured matmul and the
memory share is against the measured bandwidth itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys

import jax
import jax.numpy as jnp

from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.mask import CausalMask
from eqgpt.plan.slices import CHIPS
from eqgpt.profile import matmul_flops
from eqgpt.profile.flops import peak_flops
from eqgpt.profile.timing import median_seconds

ROWS = (1024, 4096, 16384)
# (k, n) pairs, each measured as [m,k]@[k,n] then [m,n]@[n,k]: GPT-2 small/medium MLP, Llama 1B MLP and
# attention projections, Llama 8B MLP, attention and KV projections.
PAIRS = ((768, 3072), (1024, 4096), (2048, 5632), (2048, 2048), (4096, 14336), (4096, 4096), (4096, 1024))
LENGTHS = (512, 1024, 2048, 4096, 8192)
UNROLL = 4  # matmul pairs per loop iteration (the loop's own cost spread over four)
_KINDS = {"TPU v5 lite": "v5e", "TPU v5p": "v5p", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4"}


def chip_name(device) -> str | None:
    """The catalogue's chip of a device (`None` off TPU)."""
    return next((c for kind, c in _KINDS.items() if device.platform == "tpu" and kind in device.device_kind), None)


def steady_seconds(loop, carry, *args, repeats: int, target_s: float) -> tuple[float, int]:
    """Seconds per iteration of `loop(n, carry, *args)` (a jitted `fori_loop` of `n` iterations) at
    steady state: (time of 2N - time of N) / N, with N doubled until N iterations take about `target_s`.
    **Returns** (seconds, N)."""
    def time_of(n, r):
        return median_seconds(loop, jnp.int32(n), carry, *args, repeats=r)

    n, quick = 1, max(3, repeats // 2)
    t_n = time_of(n, quick)
    while n < 2**20:
        t_2n = time_of(2 * n, quick)
        if t_2n - t_n >= target_s:
            break
        n, t_n = 2 * n, t_2n
    return max(time_of(2 * n, repeats) - time_of(n, repeats), 1e-12) / n, n


def matmul_rows(rows, pairs, dtype, peak, repeats, target_s) -> list[dict]:
    def body(_, x, w1, w2):
        barrier = jax.lax.optimization_barrier  # no reassociating the chain into dot(x, dot(w1, w2))
        for _ in range(UNROLL):
            x = barrier(jnp.dot(barrier(jnp.dot(x, w1)), w2))
        return x

    loop = jax.jit(lambda n, x, w1, w2: jax.lax.fori_loop(0, n, lambda i, x: body(i, x, w1, w2), x))
    out = []
    for m in rows:
        for k, n in pairs:
            kx, k1, k2 = jax.random.split(jax.random.key(m + k + n), 3)
            x = jax.random.normal(kx, (m, k), dtype)
            w1 = (jax.random.normal(k1, (k, n), jnp.float32) / math.sqrt(k)).astype(dtype)  # keeps x near unit scale
            w2 = (jax.random.normal(k2, (n, k), jnp.float32) / math.sqrt(n)).astype(dtype)
            counted = matmul_flops(jax.jit(body).lower(0, x, w1, w2).compile())
            expected = UNROLL * 4 * m * k * n
            if abs(counted - expected) > 0.01 * expected:
                raise RuntimeError(f"matmul [{m},{k}]x[{k},{n}]: the compiled body has {counted:.4g} matmul FLOPs, "
                                   f"not {expected:.4g}: XLA rewrote the chain, the timing would mislead")
            seconds, iters = steady_seconds(loop, x, w1, w2, repeats=repeats, target_s=target_s)
            per_matmul = seconds / (2 * UNROLL)
            eff = 2 * m * k * n / per_matmul / peak
            out += [{"m": m, "k": a, "n": b, "ms": 1e3 * per_matmul, "iterations": iters, "efficiency": eff}
                    for a, b in ((k, n), (n, k))]
    return out


def attention_rows(lengths, tokens, heads, head_dim, dtype, kernel, peak, repeats, target_s) -> list[dict]:
    f = get_kernel(kernel)
    out = []
    for t in lengths:
        b = max(1, tokens // t)
        ks = jax.random.split(jax.random.key(t + head_dim), 4)
        q, k, v, ct = (jax.random.normal(key, (b, t, heads, head_dim), dtype) for key in ks)
        pos = jnp.arange(t)

        def step(_, q, k, v, ct, pos):
            _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos), q, k, v)
            dq, dk, dv = vjp(ct)
            # The next call's queries depend on all three gradients through one element: no pass over memory.
            nudge = (dq[0, 0, 0, 0] + dk[0, 0, 0, 0] + dv[0, 0, 0, 0]).astype(q.dtype) * jnp.asarray(1e-3, q.dtype)
            return q.at[0, 0, 0, 0].add(nudge)

        loop = jax.jit(lambda n, q, k, v, ct, pos, step=step: jax.lax.fori_loop(
            0, n, lambda i, q: step(i, q, k, v, ct, pos), q))
        seconds, iters = steady_seconds(loop, q, k, v, ct, pos, repeats=repeats, target_s=target_s)
        flops = b * t * 6 * t * heads * head_dim
        out.append({"seq_len": t, "head_dim": head_dim, "ms": 1e3 * seconds, "iterations": iters,
                    "efficiency": flops / seconds / peak})
    return out


def memory_row(elements, dtype, bandwidth, repeats, target_s) -> dict:
    a, c = jnp.asarray(1.0001, dtype), jnp.asarray(1e-4, dtype)
    loop = jax.jit(lambda n, x: jax.lax.fori_loop(0, n, lambda i, x: x * a + c, x))
    x = jnp.ones((elements,), dtype)
    seconds, iters = steady_seconds(loop, x, repeats=repeats, target_s=target_s)
    moved = 2 * elements * jnp.dtype(dtype).itemsize  # read x, write the result
    achieved = moved / seconds
    return {"bytes": moved, "ms": 1e3 * seconds, "iterations": iters, "achieved": achieved,
            "efficiency": achieved / (bandwidth or achieved)}


def table(data: dict) -> str:
    lines = [f"planner calibration: {data['device']}; jax {data['jax']}; peak {data['peak_flops']:.3g} FLOP/s "
             f"({data['peak_source']}); HBM {data['hbm_bandwidth']:.3g} B/s; steady state: ms per operation = "
             "(time of 2N iterations - time of N) / N",
             f"matmul [m,k]@[k,n] (measured in pairs with [m,n]@[n,k], {UNROLL} pairs an iteration):",
             f"{'m':>7} {'k':>6} {'n':>6} {'ms':>9} {'N':>6} {'eff':>6}"]
    lines += [f"{r['m']:>7} {r['k']:>6} {r['n']:>6} {r['ms']:>9.4f} {r['iterations']:>6} {r['efficiency']:>6.1%}"
              for r in data["matmul"]]
    lines += [f"attention ({data['attention_kernel']}, fwd+bwd, causal, {data['attention_tokens']} tokens a call):",
              f"{'T':>7} {'d':>4} {'ms':>9} {'N':>6} {'eff':>6}"]
    lines += [f"{r['seq_len']:>7} {r['head_dim']:>4} {r['ms']:>9.3f} {r['iterations']:>6} {r['efficiency']:>6.1%}"
              for r in data["attention"]]
    m = data["memory"]
    lines.append(f"memory-bound x <- a*x+b: {m['bytes'] / 2**20:.0f} MiB moved in {m['ms']:.3f} ms "
                 f"(N={m['iterations']}) = {m['achieved']:.3g} B/s, {m['efficiency']:.1%} of HBM")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the calibration JSON here")
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU check of the script)")
    parser.add_argument("--repeats", type=int, default=5, help="calls per timing (their median is taken)")
    parser.add_argument("--target-ms", type=float, default=40.0, help="about how long N iterations take")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    chip = chip_name(device)
    on_tpu = chip is not None
    dtype = jnp.bfloat16 if on_tpu else jnp.float32
    peak, source = (CHIPS[chip].peak_flops, f"catalogue ({chip})") if on_tpu else peak_flops(device)
    bandwidth = CHIPS[chip].hbm_bandwidth if on_tpu else None
    rows, pairs, lengths, tokens = (ROWS, PAIRS, LENGTHS, 16384) if not args.quick else \
        ((64, 128), ((128, 256),), (128, 256), 512)
    kernel = "flash" if on_tpu else "blockwise"
    heads = 12 if not args.quick else 2
    target = args.target_ms / 1e3
    data = {
        "chip": chip or device.platform, "device": device.device_kind, "jax": jax.__version__, "provisional": False,
        "peak_flops": peak, "peak_source": source, "attention_kernel": kernel, "attention_tokens": tokens,
        "method": "steady state: (time of 2N loop iterations - time of N) / N, inside one jitted program",
        "matmul": matmul_rows(rows, pairs, dtype, peak, args.repeats, target),
        "attention": [r for d in ((64, 128) if not args.quick else (64,))
                      for r in attention_rows(lengths, tokens, heads if d == 64 else heads // 2, d, dtype, kernel,
                                              peak, args.repeats, target)],
    }
    mem = memory_row((2**27 if not args.quick else 2**20), dtype, bandwidth, args.repeats, target)
    data["memory"] = mem
    data["hbm_bandwidth"] = bandwidth or mem["achieved"]
    text = table(data)
    print(text)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    data["source"] = (f"measured by `python benchmarks/plan_calibration.py {command}`"
                      f" on {device.device_kind}, {datetime.date.today().isoformat()}")
    data["output"] = text
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
