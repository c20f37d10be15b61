"""Per-device memory and communication of sequence-sharded attention (compiled, never run).

For one attention forward+backward (`value_and_grad` of `sum(attention(q, k, v) * ct)`),
Llama-like heads (8 query heads, 2 kv heads, head_dim 64, batch 1), causal mask:

- temporaries per device from `compiled.memory_analysis()` for the single-device
  blockwise kernel, ring attention, all-gather-KV attention and Ulysses (all-to-all,
  the blockwise kernel on the whole sequence of one head per device) on 8 devices;
- bytes each device sends, from the compiled HLO (`eqgpt.profile.collectives`),
  next to the analytic figures of docs/parallelism/context.md.

Run: `python benchmarks/context_memory.py [--seq 4096 16384]`.
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
from eqgpt.parallel.context import ContextKernel, ulysses_bytes  # noqa: E402
from eqgpt.profile import collectives, memory  # noqa: E402

H, G, D, BLOCK = 8, 2, 64, 128


def compile_grad(kernel, sharding, seq: int):
    mask, pos = CausalMask(), jnp.arange(seq)

    def loss(q, k, v, ct):
        return jnp.sum(kernel(q, k, v, mask=mask, q_pos=pos, k_pos=pos) * ct)

    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding)  # noqa: E731
    args = spec(1, seq, H, D), spec(1, seq, G, D), spec(1, seq, G, D), spec(1, seq, H, D)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(*args).compile()


def sent_bytes(compiled, mesh) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in collectives(compiled, mesh):
        if r.group_size > 1:
            out[r.kind] = out.get(r.kind, 0) + r.total_bytes
    return out


def main(seqs: list[int]):
    mesh = make_mesh("context=8")
    n = mesh.shape["context"]
    one = NamedSharding(make_mesh("context=1", devices=jax.devices()[:1]), P())
    blockwise = functools.partial(blockwise_attention, block_q=BLOCK, block_k=BLOCK)
    split = NamedSharding(mesh, P(None, "context"))
    mib = lambda b: f"{b / 2**20:9.1f}"  # noqa: E731
    print(f"attention fwd+bwd, batch 1, heads {H}/{G} kv, head_dim {D}, fp32, causal, tiles {BLOCK}; "
          f"{n} devices on 'context'")
    print(f"{'seq':>7} {'kernel':<22} {'temp MiB/device':>15} {'vs 1 device':>12}")
    comm = []
    for seq in seqs:
        single = compile_grad(blockwise, one, seq)
        base = memory(single).temp_bytes
        print(f"{seq:>7} {'blockwise, 1 device':<22} {mib(base):>15} {1:>12.3f}")
        for impl in ("ring", "allgather", "ulysses"):
            kernel = ContextKernel(mesh, impl, block_q=BLOCK, block_k=BLOCK, replaces=blockwise)
            compiled = compile_grad(kernel, split, seq)
            temp = memory(compiled).temp_bytes
            print(f"{seq:>7} {impl + ', 8 devices':<22} {mib(temp):>15} {temp / base:>12.3f}")
            comm.append((seq, impl, sent_bytes(compiled, mesh)))
    print()
    print("bytes per device: HLO (eqgpt.profile; an all-gather / reduce-scatter row counts the whole")
    print("array, n kv_i; an all-to-all row the whole local block) vs analytic bytes on the wire;")
    print("kv_i = |k_i| + |v_i| and q_i = |q_i| = |out_i| of one shard, fp32; Ulysses repeats each")
    print(f"of the {G} kv heads {n // G if n % G == 0 else n} times to {n} heads (kv_i becomes {n // G} kv_i)")
    print(f"{'seq':>7} {'kernel':<10} {'collective':<28} {'HLO MiB':>9} {'analytic MiB':>13}  formula")
    for seq, impl, sent in comm:
        kv_i = 2 * (seq // n) * G * D * 4
        for kind, b in sorted(sent.items()):
            if kind == "all-reduce":  # value_and_grad: the loss, summed over the devices
                formula, analytic = "the loss value (one fp32 scalar)", 4
            elif impl == "ring":  # + the positions, 4 bytes a token
                formula, analytic = "(n-1) kv_i fwd + (n-1) kv_i + n dkv_i bwd", (3 * n - 2) * kv_i
            elif impl == "ulysses" and kind == "all-to-all":
                formula = "(n-1)/n (2 q_i + r kv_i) fwd, the same bwd"  # q, k, v in; out back
                analytic = 2 * ulysses_bytes(rows=1, seq=seq, num_heads=H, num_kv_heads=G, head_dim=D, n=n)
            elif impl == "ulysses":  # positions, 4 bytes a token
                formula, analytic = "positions: (n-1)/n of 4 T bytes", (n - 1) / n * 4 * seq
            elif kind == "all-gather":  # the HLO column counts the whole gathered array, n kv_i
                formula, analytic = "fwd, kept for bwd: (n-1) kv_i on the wire", (n - 1) * kv_i
            else:
                formula, analytic = "bwd, dK dV: (n-1) kv_i on the wire", (n - 1) * kv_i
            print(f"{seq:>7} {impl:<10} {kind:<28} {mib(b):>9} {mib(analytic):>13}  {formula}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    main(parser.parse_args().seq)
