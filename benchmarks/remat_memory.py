"""Memory and time of one training step per gradient-checkpointing (remat) policy.

For each policy the compiled `make_train_step` of the same model on one device:
temporary bytes (`memory_analysis().temp_size_in_bytes`: activations saved for the
backward pass plus the working set), host bytes (`host_temp_size_in_bytes`, where
an `offload:` policy puts its saved tensors, if the backend reports them), and the
median wall time of a step.

    python benchmarks/remat_memory.py
    python benchmarks/remat_memory.py --embed 512 --layers 8 --seq 1024 --batch 8

The table in docs/memory.md comes from the default arguments on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqgpt  # noqa: E402
from eqgpt import nn  # noqa: E402
from eqgpt.data import Batch  # noqa: E402
from eqgpt.profile import memory  # noqa: E402
from eqgpt.train import TrainState, make_train_step  # noqa: E402

POLICIES = ("none", "dots", "names:query_proj,key_proj,value_proj,mlp_in", "names:attn_out,mlp_out", "full",
            "offload:query_proj,key_proj,value_proj,attn_out,mlp_in,mlp_out")


def measure(config: eqgpt.GPTConfig, remat: str, batch: int, steps: int) -> dict:
    model = nn.GPT(config.replace(remat=remat), key=jax.random.key(0))
    optimizer = optax.adamw(1e-3)
    state = TrainState(model, optimizer.init(eqx.filter(model, eqx.is_array)), rng=jax.random.key(1))
    windows = np.asarray(jax.random.randint(jax.random.key(2), (batch, config.seq_len + 1), 0, config.vocab_size))
    data = jax.device_put(Batch.from_windows(windows))
    try:
        compiled = make_train_step(optimizer, donate=False).lower(state, data).compile()
    except Exception as e:  # noqa: BLE001  (e.g. a backend without host memory for offload)
        return {"remat": remat, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    mem = memory(compiled)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(state, data))
        times.append(time.perf_counter() - t)
    return {"remat": remat, "temp": mem.temp_bytes, "host": mem.host_bytes, "step_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--policies", nargs="*", default=list(POLICIES))
    a = p.parse_args()
    config = eqgpt.GPTConfig(vocab_size=256, seq_len=a.seq, num_layers=a.layers, num_heads=a.heads,
                             embed_dim=a.embed)
    print(f"GPT {a.layers} layers x {a.embed} wide, seq {a.seq}, batch {a.batch}, {jax.default_backend()}")
    print("| remat | temporaries MiB | host MiB | step s |\n|---|---|---|---|")
    for remat in a.policies:
        r = measure(config, remat, a.batch, a.steps)
        if "error" in r:
            print(f"| `{remat}` | {r['error']} | | |")
        else:
            print(f"| `{remat}` | {r['temp'] / 2**20:.1f} | {r['host'] / 2**20:.1f} | {r['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
