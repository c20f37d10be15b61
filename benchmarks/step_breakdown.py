"""Where a single-device training step's time goes: forward, loss, backward, optimizer, whole step.

Each part is its own compiled function, timed in alternating rounds (one call of
each per round; medians), next to a `jnp.dot` of two 2048 x 2048 fp32 matrices
timed in the same rounds: the CPU's practical matmul throughput, against which
each part's achieved FLOP/s is read.

- forward: `lm_loss` (embeddings, blocks, head, chunked cross-entropy);
- loss: the head and chunked cross-entropy alone, on fixed hidden states;
- forward + backward: `jax.value_and_grad` of the same loss; backward = the
  difference with forward;
- optimizer: `make_train_step` with a `grad_fn` that returns ready gradients
  (clipping, AdamW, the finite guard and the update);
- whole step: `make_train_step` as training runs it.

FLOPs: `eqgpt.profile.flops` (6 per matmul weight per token, causal attention
`6 L T D`; forward a third of it, backward two thirds).
Run: `python benchmarks/step_breakdown.py [--layers 4 --embed 256 --seq 256 --batch 8]`.
The default is the configuration of the speed issue: L=4, H=4, D=256, T=256, B=8,
vocab 256, no biases, tied head, fp32, AdamW, reference kernel, layers unrolled as
the recipe runs them (`--scan-layers` for one `lax.scan`).
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT, chunked_cross_entropy, lm_loss
from eqgpt.profile.flops import flops_per_token, matmul_params
from eqgpt.train import Strategy, TrainState, make_optimizer, make_train_step


def build(args):
    cfg = eqgpt.GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers, num_heads=args.heads,
        embed_dim=args.embed, use_bias=False, tie_embeddings=True, attention_kernel=args.kernel,
        scan_layers=args.scan_layers,
    )
    strategy = Strategy()
    opt = make_optimizer(1e-3)
    model = strategy.init_model(lambda k: GPT(cfg, key=k), jax.random.key(0))
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1)).astype(np.int32)
    batch = strategy.batch(Batch.from_windows(windows))
    hidden = jax.random.normal(jax.random.key(1), (args.batch, cfg.seq_len, cfg.embed_dim))

    def loss(m, b):
        return lm_loss(m, b.tokens, b.targets)[0]

    params = eqx.filter(model, eqx.is_array)
    ready_grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)

    def fixed_grad_fn(m, b):  # gradients already computed: the step is the optimizer alone
        return (jnp.zeros(()), {}), ready_grads

    def state():
        return TrainState(model, strategy.init_opt_state(opt, model), rng=jax.random.key(2))

    parts = {
        "forward": (eqx.filter_jit(loss), (model, batch)),
        "loss (head + cross-entropy)": (
            eqx.filter_jit(lambda m, h, y: chunked_cross_entropy(m.logits, h, y)[0]), (model, hidden, batch.targets)),
        "forward + backward": (eqx.filter_jit(eqx.filter_value_and_grad(loss)), (model, batch)),
        "optimizer update": (make_train_step(opt, grad_fn=fixed_grad_fn, donate=False), (state(), batch)),
        "whole step": (make_train_step(opt, donate=False), (state(), batch)),
    }
    return cfg, parts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--scan-layers", action="store_true", help="the layers as one lax.scan (default: unrolled)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--kernel", default="reference")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; medians are reported")
    args = p.parse_args()

    cfg, parts = build(args)
    n = 2048
    a = jax.random.normal(jax.random.key(0), (n, n))
    dot = jax.jit(jnp.dot)
    calls = {name: (lambda f=f, xs=xs: f(*xs)) for name, (f, xs) in parts.items()}
    calls["jnp.dot 2048^2"] = lambda: dot(a, a)
    for f in calls.values():  # compile and warm up
        jax.block_until_ready(f())
    times = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, f in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    peak = 2 * n**3 / med["jnp.dot 2048^2"]

    tokens = args.batch * cfg.seq_len
    train = flops_per_token(cfg) * tokens
    head = 2 * cfg.embed_dim * cfg.vocab_size * tokens
    flops = {"forward": train / 3, "loss (head + cross-entropy)": head, "forward + backward": train,
             "backward (difference)": 2 * train / 3, "optimizer update": None, "whole step": train}
    med["backward (difference)"] = med["forward + backward"] - med["forward"]
    order = ["forward", "loss (head + cross-entropy)", "backward (difference)", "forward + backward",
             "optimizer update", "whole step"]

    print(f"model: L={cfg.num_layers} H={cfg.num_heads} D={cfg.embed_dim} T={cfg.seq_len} B={args.batch} "
          f"vocab={cfg.vocab_size} kernel={cfg.attention_kernel}; {matmul_params(cfg) / 1e6:.2f} M matmul "
          f"params, {flops_per_token(cfg) / 1e6:.1f} MFLOP/token; device {jax.devices()[0]}; {args.rounds} rounds")
    print(f"matmul throughput (jnp.dot 2048^2 fp32, same rounds): {peak / 1e9:.1f} GFLOP/s\n")
    w = max(len(k) for k in order)
    print(f"{'part':<{w}}  {'ms':>8}  {'GFLOP/s':>8}  {'of matmul':>9}")
    for k in order:
        f = flops[k]
        rate = "-" if f is None else f"{f / med[k] / 1e9:.1f}"
        frac = "-" if f is None else f"{f / med[k] / peak:.0%}"
        print(f"{k:<{w}}  {med[k] * 1e3:8.1f}  {rate:>8}  {frac:>9}")
    print(f"\nbackward / forward: {med['backward (difference)'] / med['forward']:.2f}   "
          f"(forward + backward) / forward: {med['forward + backward'] / med['forward']:.2f}")
    print(f"whole step: {tokens / med['whole step']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
