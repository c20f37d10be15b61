"""Training FLOPs per token and model FLOP utilisation (MFU).

FLOPs per token = `6 * matmul_params + 6 * L * T * D`: forward and backward of every
matmul weight (the unembedding included, the input embedding lookup not), plus
causal attention's scores and weighted sum (half of the dense `12 * L * T * D`).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from eqgpt.config import GPTConfig

# Dense bf16 peak FLOP/s per device, by substring of `jax.Device.device_kind`.
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
    "L4": 121e12, "RTX 4090": 165e12, "V100": 125e12, "T4": 65e12,
}
# bf16 dense peak per chip, by JAX's `device_kind` (Google Cloud's TPU pages).
TPU_PEAK_FLOPS = {"TPU v5 lite": 197e12, "TPU v6 lite": 918e12, "TPU v5p": 459e12, "TPU v4": 275e12}


def matmul_params(config: GPTConfig) -> int:
    """Weights that take part in a matmul per token: attention, MLP and the output head.

    For MoE layers: the router and the active experts (`top_k` routed plus the shared
    ones), not all experts; capacity padding is not counted (it is not useful work).
    """
    c = config
    d, kv = c.embed_dim, c.kv_heads * c.head_dim
    attn = 2 * d * d + 2 * d * kv
    per_width = (3 if c.mlp == "swiglu" else 2) * d
    mlp = per_width * c.hidden_dim
    layers = c.num_layers * (attn + mlp)
    if c.moe is not None:
        m = c.moe
        moe_layers = c.num_layers // m.every
        active = per_width * (m.expert_dim or c.hidden_dim) * (m.top_k + m.num_shared) + d * m.num_experts
        layers += moe_layers * (active - mlp)
    return layers + d * c.vocab_size


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token at sequence length `seq_len` (default `config.seq_len`)."""
    t = config.seq_len if seq_len is None else seq_len
    return 6 * matmul_params(config) + 6 * config.num_layers * t * config.embed_dim


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Achieved training FLOP/s as a fraction of `peak_flops`."""
    return tokens_per_second * flops_per_token / peak_flops


@functools.cache
def measure_matmul_flops(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of one large `jnp.dot` on the default device (median of `repeats`).

    The practical ceiling of a CPU: there is no table of CPU peaks worth trusting.
    Measured once per process (a second run in the same process reuses it).
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(times))


def peak_flops(device: jax.Device | None = None) -> tuple[float, str]:
    """A peak FLOP/s for MFU and where it came from: the GPU or TPU table, else a measured matmul."""
    device = jax.devices()[0] if device is None else device
    table = {"gpu": GPU_PEAK_FLOPS, "tpu": TPU_PEAK_FLOPS}.get(device.platform, {})
    for name, flops in table.items():
        if name.lower() in device.device_kind.lower():
            return flops, f"table ({name} bf16 dense)"
    return measure_matmul_flops(), "measured jnp.dot 2048x2048 fp32"
