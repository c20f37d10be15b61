"""The planner's calibration table (`eqgpt.plan.calibration`), measured on this machine's first device.

Three classes of operation, each timed alone (median of `--repeats` compiled calls), never a
whole model:

- matmuls `[m, k] @ [k, n]` by shape (the widths of GPT-2 to Llama 3 8B, the rows of a device's
  tokens), efficiency = 2mkn / (time x peak);
- the attention kernel (forward + backward, causal; `flash` on TPU, `blockwise` elsewhere) by
  sequence length at 16k tokens per call, efficiency = eqgpt's attention FLOPs (`6 T D` per
  token, `eqgpt.profile.flops`) / (time x peak);
- memory-bound work: `a * x + b` over large arrays, bytes moved / time over the chip's HBM
  bandwidth (`eqgpt.plan.slices.CHIPS`).

Prints the table and writes the JSON the planner reads, with the command and the output it
came from. On a TPU v5e (what the lead runs):

    python benchmarks/plan_calibration.py --out src/eqgpt/plan/calibration/v5e.json

On CPU (`--quick`: small shapes, to check the script) the peak is a measured matmul and the
memory share is against the measured bandwidth itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp

from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.mask import CausalMask
from eqgpt.plan.slices import CHIPS
from eqgpt.profile.flops import peak_flops
from eqgpt.profile.timing import median_seconds

ROWS = (1024, 4096, 16384)
WIDTHS = ((768, 3072), (3072, 768), (2048, 5632), (5632, 2048), (2048, 2048), (4096, 14336), (14336, 4096),
          (4096, 4096), (4096, 1024))
LENGTHS = (512, 1024, 2048, 4096, 8192)
_KINDS = {"TPU v5 lite": "v5e", "TPU v5p": "v5p", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4"}


def chip_name(device) -> str | None:
    """The catalogue's chip of a device (`None` off TPU)."""
    return next((c for kind, c in _KINDS.items() if device.platform == "tpu" and kind in device.device_kind), None)


def matmul_rows(rows, widths, dtype, peak, repeats) -> list[dict]:
    out = []
    dot = jax.jit(jnp.dot)
    for m in rows:
        for k, n in widths:
            a = jnp.ones((m, k), dtype)
            b = jnp.ones((k, n), dtype)
            seconds = median_seconds(dot, a, b, repeats=repeats)
            out.append({"m": m, "k": k, "n": n, "ms": 1e3 * seconds, "efficiency": 2 * m * k * n / seconds / peak})
    return out


def attention_rows(lengths, tokens, heads, head_dim, dtype, kernel, peak, repeats) -> list[dict]:
    out = []
    f = get_kernel(kernel)
    for t in lengths:
        b = max(1, tokens // t)
        ks = jax.random.split(jax.random.key(0), 4)
        q, k, v, ct = (jax.random.normal(key, (b, t, heads, head_dim), dtype) for key in ks)
        pos = jnp.arange(t)

        def loss(q, k, v, ct=ct, pos=pos):
            return jnp.sum((f(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos) * ct).astype(jnp.float32))

        seconds = median_seconds(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, repeats=repeats)
        flops = b * t * 6 * t * heads * head_dim
        out.append({"seq_len": t, "head_dim": head_dim, "ms": 1e3 * seconds, "efficiency": flops / seconds / peak})
    return out


def memory_row(elements, dtype, bandwidth, repeats) -> dict:
    x = jnp.ones((elements,), dtype)
    f = jax.jit(lambda x: x * jnp.asarray(1.5, dtype) + jnp.asarray(0.5, dtype))
    seconds = median_seconds(f, x, repeats=repeats)
    moved = 2 * elements * jnp.dtype(dtype).itemsize  # read x, write the result
    achieved = moved / seconds
    return {"bytes": moved, "ms": 1e3 * seconds, "achieved": achieved,
            "efficiency": achieved / (bandwidth or achieved)}


def table(data: dict) -> str:
    lines = [f"planner calibration: {data['device']}; jax {data['jax']}; peak {data['peak_flops']:.3g} FLOP/s "
             f"({data['peak_source']}); HBM {data['hbm_bandwidth']:.3g} B/s", "matmul [m,k]@[k,n]:",
             f"{'m':>7} {'k':>6} {'n':>6} {'ms':>9} {'eff':>6}"]
    lines += [f"{r['m']:>7} {r['k']:>6} {r['n']:>6} {r['ms']:>9.3f} {r['efficiency']:>6.1%}" for r in data["matmul"]]
    lines += [f"attention ({data['attention_kernel']}, fwd+bwd, causal, {data['attention_tokens']} tokens):",
              f"{'T':>7} {'d':>4} {'ms':>9} {'eff':>6}"]
    lines += [f"{r['seq_len']:>7} {r['head_dim']:>4} {r['ms']:>9.3f} {r['efficiency']:>6.1%}"
              for r in data["attention"]]
    m = data["memory"]
    lines.append(f"memory-bound a*x+b: {m['bytes'] / 2**20:.0f} MiB moved in {m['ms']:.3f} ms = "
                 f"{m['achieved']:.3g} B/s, {m['efficiency']:.1%} of HBM")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the calibration JSON here")
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU check of the script)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    chip = chip_name(device)
    on_tpu = chip is not None
    dtype = jnp.bfloat16 if on_tpu else jnp.float32
    peak, source = (CHIPS[chip].peak_flops, f"catalogue ({chip})") if on_tpu else peak_flops(device)
    bandwidth = CHIPS[chip].hbm_bandwidth if on_tpu else None
    rows, widths, lengths, tokens = (ROWS, WIDTHS, LENGTHS, 16384) if not args.quick else \
        ((128, 256), ((128, 256), (256, 128)), (128, 256), 512)
    kernel = "flash" if on_tpu else "blockwise"
    heads = 12 if not args.quick else 2
    data = {
        "chip": chip or device.platform, "device": device.device_kind, "jax": jax.__version__, "provisional": False,
        "peak_flops": peak, "peak_source": source, "attention_kernel": kernel, "attention_tokens": tokens,
        "matmul": matmul_rows(rows, widths, dtype, peak, args.repeats),
        "attention": [r for d in ((64, 128) if not args.quick else (64,))
                      for r in attention_rows(lengths, tokens, heads if d == 64 else heads // 2, d, dtype, kernel,
                                              peak, args.repeats)],
    }
    mem = memory_row((2**27 if not args.quick else 2**22), dtype, bandwidth, args.repeats)
    data["memory"] = mem
    data["hbm_bandwidth"] = bandwidth or mem["achieved"]
    text = table(data)
    print(text)
    data["source"] = (f"measured by `python benchmarks/plan_calibration.py {' '.join(argv or sys.argv[1:])}` on "
                      f"{device.device_kind}, {datetime.date.today().isoformat()}")
    data["output"] = text
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
