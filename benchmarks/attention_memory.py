"""Compiled temporary memory of attention forward + backward: reference vs blockwise.

The reference kernel materialises `[heads, T, T]` scores, so its memory grows
quadratically; the blockwise kernel keeps `[heads, block_q, block_k]` scores and
fp32 row statistics, so its memory grows linearly. Only compiles (never runs), so
it takes seconds on CPU. Run: `python benchmarks/attention_memory.py`.
"""

import jax
import jax.numpy as jnp

from eqgpt.nn.kernels.blockwise import blockwise_attention
from eqgpt.nn.kernels.reference import reference_attention
from eqgpt.nn.mask import CausalMask

LENGTHS = (1024, 4096, 8192)
BATCH, HEADS, HEAD_DIM = 1, 4, 64


def temp_bytes(kernel, length: int) -> int:
    """Temporary bytes XLA allocates for grad(sum(attention(q, k, v)))."""
    shape = jax.ShapeDtypeStruct((BATCH, length, HEADS, HEAD_DIM), jnp.float32)
    pos = jnp.arange(length)

    def loss(q, k, v):
        return jnp.sum(kernel(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def main():
    kernels = {"reference": reference_attention, "blockwise": blockwise_attention}
    table = {name: [temp_bytes(fn, t) for t in LENGTHS] for name, fn in kernels.items()}
    mib = 2**20
    header = f"{'kernel':<10}" + "".join(f"{f'T={t} MiB':>14}" for t in LENGTHS)
    header += f"{'4096/1024':>11}{'8192/4096':>11}"
    print(f"fwd+bwd temp memory, batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, causal")
    print(header)
    for name, sizes in table.items():
        row = f"{name:<10}" + "".join(f"{b / mib:>14.1f}" for b in sizes)
        row += f"{sizes[1] / sizes[0]:>11.2f}{sizes[2] / sizes[1]:>11.2f}"
        print(row)
    print("linear growth gives ratios 4 and 2; quadratic gives 16 and 4.")


if __name__ == "__main__":
    main()
