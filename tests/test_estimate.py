"""`eqgpt.profile.estimate` against the compiled step's `memory_analysis`.

Six strategies on 8 CPU devices, one small GPT: the estimate's parameters +
optimizer state + batch must match the compiled `argument_bytes` within 5%, and
its gradients + activations the compiled `temp_bytes` within 25%.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import eqgpt
from eqgpt.data import Batch
from eqgpt.nn import GPT
from eqgpt.parallel import Pipeline, Strategy, Zero, make_mesh
from eqgpt.profile import estimate, memory
from eqgpt.train import TrainState, make_train_step

CONFIG = eqgpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, embed_dim=64)
BATCH = 16
CASES = {
    "single": lambda: Strategy(),
    "dp": lambda: Strategy(make_mesh("data=8"), "dp"),
    "fsdp": lambda: Strategy(make_mesh("fsdp=8"), "fsdp"),
    "fsdp+tp": lambda: Strategy(make_mesh("fsdp=2,tensor=4"), "fsdp+tp"),
    "pipeline-1f1b": lambda: Strategy(make_mesh("pipeline=2,data=4"), "dp", parts=(Pipeline("1f1b", 2),)),
    "zero1": lambda: Strategy(make_mesh("data=8"), "dp", parts=(Zero(1),)),
}


def compiled_memory(strategy: Strategy):
    make = lambda k: GPT(CONFIG, key=k)  # noqa: E731
    model = strategy.init_model(make, jax.random.key(0))
    optimizer = optax.adamw(1e-3)
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    step = make_train_step(optimizer, strategy=strategy, model_like=model, donate=False)
    tokens = np.random.default_rng(0).integers(0, 256, (BATCH, CONFIG.seq_len + 1)).astype(np.int32)
    return memory(step.lower(state, strategy.batch(Batch.from_windows(tokens))).compile())


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_matches_compiled_memory(name):
    strategy = CASES[name]()
    predicted = estimate(CONFIG, strategy=strategy, batch=BATCH)  # nothing compiled yet
    measured = compiled_memory(strategy)
    print(predicted.table(measured, title=name))
    assert predicted.arguments == pytest.approx(measured.argument_bytes, rel=0.05)
    assert predicted.temporaries == pytest.approx(measured.temp_bytes, rel=0.25)


def test_estimate_needs_no_devices_and_scales_with_the_strategy():
    one = estimate(CONFIG, batch=BATCH)
    fsdp = estimate(CONFIG, make_mesh("fsdp=8"), "fsdp", batch=BATCH)
    zero = estimate(CONFIG, strategy=Strategy(make_mesh("data=8"), "dp", parts=(Zero(1),)), batch=BATCH)
    dp = estimate(CONFIG, make_mesh("data=8"), "dp", batch=BATCH)
    assert one.opt_state == 2 * one.params  # AdamW: two fp32 moments per parameter
    assert fsdp.params < one.params / 7 and fsdp.opt_state < one.opt_state / 7
    assert zero.params == dp.params and zero.opt_state < dp.opt_state / 7
    assert dp.activations < one.activations / 4  # 2 rows per device instead of 16
    full = estimate(CONFIG, batch=BATCH, remat="full")
    assert full.activations < one.activations / 2
    bf16 = estimate(CONFIG, batch=BATCH, policy=eqgpt.train.Policy.named("bf16"))
    assert bf16.activations < one.activations
