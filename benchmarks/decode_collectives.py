"""The collectives of one compiled decode step under tensor parallelism, and when TP pays.

Part 1 compiles one step of `eqgpt.sample.generate`'s decode loop (one new token per
row against the KV cache, greedy pick, the cache constrained to its layout) for a
small GPT under `tensor=4` (4 of the 8 CPU devices) and `data=2,tensor=4`, and
prints every collective from the compiled HLO (`eqgpt.profile.collectives`) next to
Megatron's analytic count (`analytic`).

Part 2 is arithmetic for real presets in bf16: the HBM bytes each device reads per
decode step (weights and KV cache, split `n` ways) and the time that takes at the
v5e's 819 GB/s; the collectives TP adds per step; and the break-even latency: TP
over `n` devices pays when one of those small all-reduces takes less than the HBM
time it saves divided by their number.

Run: `python benchmarks/decode_collectives.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import collections  # noqa: E402
import math  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import eqgpt  # noqa: E402
from eqgpt import nn  # noqa: E402
from eqgpt.parallel import Strategy, make_mesh  # noqa: E402
from eqgpt.profile import collectives  # noqa: E402
from eqgpt.profile.roofline import TPU_HBM_BYTES_PER_S  # noqa: E402
from eqgpt.sample import constrain_cache, sample_logits  # noqa: E402

HBM = TPU_HBM_BYTES_PER_S["TPU v5 lite"]  # bytes/s, one v5e chip (eqgpt.profile.roofline)
SMALL = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=8, embed_dim=32)
MESHES = (("tensor=4", "tp"), ("data=2,tensor=4", "dp+tp"))


def decode_step(model, token, cache, index):
    """One step of `generate`'s decode loop, greedy: the next token of each row and the cache."""
    logits, cache = model.decode(token[:, None], cache, index)
    return sample_logits(logits[:, -1], jax.random.key(0), temperature=0), constrain_cache(model, cache)


def strategy_of(mesh: str, rules: str) -> Strategy:
    """The strategy on the first devices the mesh needs (`tensor=4`: 4 of the 8)."""
    size = math.prod(int(axis.split("=")[1]) for axis in mesh.split(","))
    return Strategy(make_mesh(mesh, jax.devices()[:size]), rules)


def compiled_step(model, strategy: Strategy, batch: int):
    """`decode_step` compiled for the placed model, `batch` rows over the batch axes, a full cache."""
    model = strategy.place_model(model)
    spec = strategy.rules.spec(("batch",), "activations", shape=(batch,), mesh=strategy.mesh)
    token = jax.device_put(jnp.zeros((batch,), jnp.int32), NamedSharding(strategy.mesh, spec))
    cache = eqx.filter_jit(lambda m: constrain_cache(m, m.init_cache(batch)))(model)
    return eqx.filter_jit(decode_step).lower(model, token, cache, jnp.int32(1)).compile()


def measured(model, strategy: Strategy, batch: int) -> list[tuple[str, int, int]]:
    """`(kind, bytes per device, runs per step)` of every collective of the compiled step, sorted."""
    rows = collectives(compiled_step(model, strategy, batch), strategy.mesh)
    assert all(r.axes == ("tensor",) for r in rows), [r.axes for r in rows]
    runs = collections.Counter()
    for r in rows:  # the decode loop over layers is unrolled: equal collectives add up
        runs[r.kind, r.bytes] += r.executions
    return sorted((kind, size, n) for (kind, size), n in runs.items())


def analytic(config: eqgpt.GPTConfig, rows: int, tensor: int, dtype_bytes: int = 4) -> list[tuple[str, int, int]]:
    """Megatron TP's collectives of one decode step, `rows` rows per device, summed by kind and
    size and sorted as `measured`:

    - Per layer, 2 all-reduces of the new position's `[rows, D]` activations: after the
      attention's output projection and after the MLP's down projection.
    - Once, an all-reduce of `[rows, 1, D]`: the vocabulary-parallel embedding lookup.
    - Once, the greedy pick over vocabulary-sharded logits: each device's largest logit
      and its id are all-gathered, `[rows, tensor]` fp32 and int32 (the logits never move).
    """
    act = dtype_bytes * rows * config.embed_dim
    pick = 4 * rows * tensor
    return sorted([("all-reduce", act, 2 * config.num_layers + 1), ("all-gather", pick, 2)])


def param_count(config: eqgpt.GPTConfig) -> int:
    shapes = eqx.filter_eval_shape(nn.GPT, config, key=jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes) if isinstance(x, jax.ShapeDtypeStruct))


def when_it_pays(name: str, batch: int, tensor: int, context: int | None = None) -> dict:
    """Per-device HBM bytes and time of one bf16 decode step over `tensor` devices, the
    collectives TP adds, and the break-even latency of one of them (against one device)."""
    c = eqgpt.preset(name)
    context = c.seq_len if context is None else context
    weights = 2 * param_count(c)
    kv = 2 * 2 * c.num_layers * batch * context * c.kv_heads * c.head_dim
    kv_split = tensor if c.kv_heads % tensor == 0 else 1  # fewer kv heads than devices: replicated

    def seconds(n, kv_n):
        return (weights / n + kv / kv_n) / HBM

    count = 2 * c.num_layers + 1 + 2 if tensor > 1 else 0
    saved = seconds(1, 1) - seconds(tensor, kv_split)
    return {"model": name, "batch": batch, "tensor": tensor, "weights_mb": weights / tensor / 1e6,
            "kv_mb": kv / kv_split / 1e6, "hbm_us": 1e6 * seconds(tensor, kv_split), "collectives": count,
            "all_reduce_kb": 2 * batch * c.embed_dim / 1e3, "break_even_us": 1e6 * saved / count if count else None}


def main() -> None:
    model = nn.GPT(SMALL, key=jax.random.key(0))
    batch = 8
    print(f"collectives of one decode step: GPT L={SMALL.num_layers} D={SMALL.embed_dim} V={SMALL.vocab_size}, "
          f"batch {batch}, fp32")
    print(f"{'mesh':<18}{'kind':<12}{'bytes/device':>13}{'runs/step':>10}{'analytic':>10}")
    for mesh, rules in MESHES:
        strategy = strategy_of(mesh, rules)
        rows = batch // strategy.mesh.shape["data"]
        got, want = measured(model, strategy, batch), analytic(SMALL, rows, strategy.mesh.shape["tensor"])
        for kind, nbytes, runs in got:
            print(f"{mesh:<18}{kind:<12}{nbytes:>13}{runs:>10}{'yes' if (kind, nbytes, runs) in want else 'NO':>10}")
    print("\nbf16 decode step, cache full (seq_len positions), HBM at 819 GB/s (v5e)")
    print(f"{'model':<12}{'batch':>6}{'n':>3}{'weights MB':>11}{'KV MB':>8}{'HBM us':>8}"
          f"{'colls':>6}{'AR KB':>7}{'break-even us':>14}")
    for name in ("gpt2-small", "llama-1b"):
        for b in (1, 8, 64):
            for n in (n for n in (1, 4, 8) if eqgpt.preset(name).num_heads % n == 0):  # whole heads
                r = when_it_pays(name, b, n)
                be = "-" if r["break_even_us"] is None else f"{r['break_even_us']:.1f}"
                print(f"{name:<12}{b:>6}{n:>3}{r['weights_mb']:>11.0f}{r['kv_mb']:>8.0f}{r['hbm_us']:>8.0f}"
                      f"{r['collectives']:>6}{r['all_reduce_kb']:>7.1f}{be:>14}")


if __name__ == "__main__":
    main()
