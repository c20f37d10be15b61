"""Host offload: the optimizer state (and, with FSDP, the parameters) live in pinned host memory between steps.

Training equals the same strategy without offload (rel 1e-6), the offloaded arrays sit
in `pinned_host` after each step, and the compiled step holds exactly their bytes as
host-memory inputs, so its device-memory inputs drop by that much.
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqgpt
from eqgpt.data import Batch
from eqgpt.nn import GPT
from eqgpt.parallel import Offload, ParallelFlags, Strategy, make_mesh
from eqgpt.profile import memory
from eqgpt.train import TrainState, make_train_step

CONFIG = eqgpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, embed_dim=64)
# SGD with momentum: a state to offload, and no Adam normalisation, which turns the rounding-level
# differences of two programs that fuse differently (offloaded or not) in gradients that are zero in
# exact arithmetic (the key bias's) into learning-rate-sized steps.
OPTIMIZER = optax.sgd(1e-2, momentum=0.9)
CASES = {
    "single": lambda offload: ParallelFlags.parse(offload_opt_state=offload),
    "fsdp": lambda offload: ParallelFlags.parse("fsdp=8", "fsdp", offload_opt_state=offload),
    "zero1": lambda offload: ParallelFlags.parse("data=8", "dp", zero=1, offload_opt_state=offload),
    "fsdp-params": lambda offload: ParallelFlags.parse("fsdp=8", "fsdp", offload_opt_state=offload,
                                                  offload_params=offload),
}


def train(strategy: Strategy, steps: int = 3):
    model = strategy.init_model(lambda k: GPT(CONFIG, key=k), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(OPTIMIZER, model), rng=jax.random.key(1))
    step = make_train_step(OPTIMIZER, strategy=strategy, model_like=model)
    rng = np.random.default_rng(0)
    batches = [strategy.batch(Batch.from_windows(rng.integers(0, 256, (16, 33)).astype(np.int32)))
               for _ in range(steps)]
    compiled = step.lower(state, batches[0]).compile()
    report = memory(compiled)
    offloaded = (state.opt_state, state.model) if getattr(strategy.part(Offload), "params", False) else state.opt_state
    host_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(offloaded) if eqx.is_array(x))
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        losses.append(float(metrics["loss"]))
    val = eqx.filter_jit(strategy.loss_fn())(state.model, batches[0])[0]  # validation reads host parameters
    return losses + [float(val)], state, report, host_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_offloaded_state_trains_the_same_and_leaves_the_device(name):
    ref_losses, ref_state, ref_mem, _ = train(CASES[name](False))
    losses, state, mem, host_bytes = train(CASES[name](True))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    floats = lambda s: jax.tree.leaves(eqx.filter((s.model, s.opt_state), eqx.is_inexact_array))  # noqa: E731
    for x, y in zip(floats(state), floats(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree) if eqx.is_array(x)}  # noqa: E731
    assert kinds(state.opt_state) == {"pinned_host"}
    assert kinds(state.model) == {"pinned_host" if "params" in name else "device"}
    # The compiled step: the offloaded arrays (per device) are its host-memory inputs, nothing else.
    assert mem.host_argument_bytes == host_bytes and ref_mem.host_argument_bytes == 0
    assert mem.device_argument_bytes == ref_mem.argument_bytes - host_bytes


def test_the_strategy_says_where_the_state_lives():
    assert "optimizer state on host" in Strategy(make_mesh("data=8"), "dp", parts=(Offload(opt_state=True),)).describe()
    assert Strategy(make_mesh("fsdp=8"), "fsdp", parts=(Offload(opt_state=True, params=True),)).describe() == \
        "fsdp | parameters and optimizer state on host"


def test_offloaded_state_saves_and_restores_into_host_memory(tmp_path):
    from eqgpt.train.checkpoint import Checkpointer

    _, state, _, _ = train(CASES["fsdp-params"](True), steps=1)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(1, state)
    restored = Checkpointer(tmp_path).restore(state).state
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if eqx.is_array(x) and eqx.is_inexact_array(x):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            assert x.sharding == y.sharding  # pinned_host, each device's shard
