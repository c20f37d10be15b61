"""Shared pieces of the parallelism tests: tiny models, one compiled train step (the
library's `make_train_step`) per (model, mesh, strategy), cached so parity and HLO
tests reuse compiles.

Compiles use `xla_backend_optimization_level=0`: it only lowers the LLVM
optimisation of the CPU kernels (the HLO, its sharding and its collectives are
unchanged) and halves compile time.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import numpy as np
import optax

import eqgpt
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.train import Strategy, TrainState, make_train_step
from markov import markov_windows

# GPT-2 style (LayerNorm, GELU, learned positions, biases, tied head) and
# Llama style (RMSNorm, SwiGLU, RoPE, GQA 8 query / 4 kv heads, untied head).
# 8 heads so tensor=8 gives one head per device; with 4 kv heads, tensor=8
# replicates the kv projections (Megatron's layout when kv heads < tensor ranks).
CONFIGS = {
    "gpt": eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=8, embed_dim=32),
    "llama": eqgpt.preset("llama-nano").replace(
        vocab_size=64, seq_len=32, num_layers=2, num_heads=8, num_kv_heads=4, embed_dim=32, mlp_dim=64
    ),
}
BATCH, SEQ, STEPS = 8, 32, 5
OPTIONS = {"xla_backend_optimization_level": 0}
OPTIMIZER = optax.adamw(1e-3)


def batches(steps: int = STEPS, vocab: int = 64) -> list[Batch]:
    """`steps` host batches of a fixed Markov chain (the same for every case): data a model
    learns from, so the loss must fall (`markov.falls`)."""
    return [Batch.from_windows(markov_windows(100 + i, BATCH, SEQ, vocab)) for i in range(steps)]


def train(strategy: Strategy, model, opt_state, steps: int = STEPS):
    """`steps` steps of the library's one train step: per-step losses, final state, compiled step."""
    step = make_train_step(OPTIMIZER, strategy=strategy, model_like=model, donate=False)
    state = TrainState(model, opt_state, rng=jax.random.key(0))
    data = [strategy.batch(b) for b in batches(steps)]
    compiled = step.lower(state, data[0]).compile(OPTIONS)
    losses = []
    for b in data:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    return losses, state, compiled


@functools.cache
def reference_model(name: str):
    init = jax.jit(lambda k: nn.GPT(CONFIGS[name], key=k))
    return init.lower(jax.random.key(0)).compile(OPTIONS)(jax.random.key(0))


def arrays(model) -> dict[str, np.ndarray]:
    """Every array of `model` by dotted path (e.g. `blocks.attn.k_proj.bias`)."""
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    return {par.path_str(path): np.asarray(x) for path, x in flat}


@functools.cache
def reference_run(name: str):
    """Single-device fp32: per-step losses, final arrays, and the compiled step."""
    model = reference_model(name)
    losses, state, compiled = train(Strategy(), model, OPTIMIZER.init(eqx.filter(model, eqx.is_array)))
    return losses, arrays(state.model), compiled


def overrides_for(key: str | None):
    """Named per-module override sets used by the tests (hashable key -> dict)."""
    if key is None:
        return None
    if key == "attn_tp_mlp_fsdp_embed_vocab":
        # Attention Megatron-sharded over tensor (and fsdp); MLP FSDP only; the token
        # table split over vocab on `tensor` instead of over embed.
        return {
            "blocks.attn": par.preset_rules("fsdp+tp"),
            "tok_embed": par.preset_rules("fsdp").update(params={"vocab": "tensor", "embed": None}),
        }
    raise KeyError(key)


@functools.cache
def sharded_run(
    name: str, mesh_spec: str, strategy: str, overrides: str | None = None, init_directly: bool = False
):
    """The same training on a mesh: losses, final arrays, compiled step, placement, model."""
    placement = Strategy(par.make_mesh(mesh_spec), strategy, overrides=overrides_for(overrides))
    placement.check(reference_model(name), batch_size=BATCH, seq_len=SEQ)
    if init_directly:  # the same weights, created sharded (init_sharded) rather than moved
        model = placement.init_model(lambda k: nn.GPT(CONFIGS[name], key=k), jax.random.key(0))
        opt_state = placement.init_opt_state(OPTIMIZER, model)
    else:  # moved rather than compiled: one compile fewer per case
        model = placement.place_model(reference_model(name))
        opt_state = placement.place_opt_state(OPTIMIZER.init(eqx.filter(model, eqx.is_array)), model)
    losses, state, compiled = train(placement, model, opt_state)
    return losses, arrays(state.model), compiled, placement, model


def param_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
