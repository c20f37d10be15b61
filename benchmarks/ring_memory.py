"""Ring attention's per-device temporaries against one device's, for the JAX installed.

The figures behind `tests/test_context_attention.py::test_ring_memory_per_device_at_16k`
(compiled, never run): `grad` of `sum(attention(q, k, v) * ct)` at 16k tokens, fp32,
batch 1, 8 query heads, 2 kv heads, head_dim 64, causal; the single-device blockwise
kernel against ring attention on `context=8`. Temporaries are XLA's
`memory_analysis().temp_size_in_bytes`. The bound is the test's: one device's / n
plus the ring's own O(T/n) buffers (k/v in flight and their fp32 gradients,
4 |k_i + v_i|; one query chunk's working set, 4 |q_i| / chunks).

Run with each interpreter to compare JAX versions:
`.venv/bin/python benchmarks/ring_memory.py` and `.venv312/bin/python benchmarks/ring_memory.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from eqgpt.nn.kernels.blockwise import blockwise_attention  # noqa: E402
from eqgpt.nn.mask import CausalMask  # noqa: E402
from eqgpt.parallel import make_mesh  # noqa: E402
from eqgpt.parallel.context import ContextKernel  # noqa: E402
from eqgpt.profile import memory  # noqa: E402

B, H, G, D = 1, 8, 2, 64
OPTIONS = {"xla_backend_optimization_level": 0}  # as the test: same HLO, faster compiles


def temp_bytes(kernel, sharding, seq: int) -> int:
    mask, pos = CausalMask(), jnp.arange(seq)

    def loss(q, k, v, ct):
        return jnp.sum(kernel(q, k, v, mask=mask, q_pos=pos, k_pos=pos) * ct)

    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)  # noqa: E731
    args = spec(B, seq, H, D), spec(B, seq, G, D), spec(B, seq, G, D), spec(B, seq, H, D)
    return memory(jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile(OPTIONS)).temp_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    seq, n = args.seq, args.devices
    single = temp_bytes(functools.partial(blockwise_attention, block_q=128, block_k=128),
                        NamedSharding(make_mesh("context=1", devices=jax.devices()[:1]), P()), seq)
    mesh = make_mesh(f"context={n}", devices=jax.devices()[:n])
    kernel = ContextKernel(mesh, "ring")
    ring = temp_bytes(kernel, NamedSharding(mesh, P(None, "context")), seq)
    shard = seq // n
    q_i, kv_i = B * shard * H * D * 4, 2 * B * shard * G * D * 4
    own = 4 * kv_i + 4 * q_i // kernel.chunks_for(shard)
    bound = single / n + own
    print(f"ring attention memory, seq {seq}, {n} devices, jax {jax.__version__}")
    print("| jax | ring per device (B) | single device (B) | ratio | bound single/n + own (B) | within |")
    print("|---|---:|---:|---:|---:|---|")
    print(f"| {jax.__version__} | {ring:,} | {single:,} | {ring / single:.3f} | {bound:,.0f} "
          f"| {'yes' if ring <= bound else 'NO'} ({ring / bound:.0%}) |")


if __name__ == "__main__":
    main()
