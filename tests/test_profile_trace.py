"""A trace of two sharded training steps: files, named scopes, collectives, and a time table that adds up."""

import jax
import numpy as np
import optax
import pytest

import eqgpt
import eqgpt.parallel as par
from eqgpt import nn
from eqgpt.data.batch import Batch
from eqgpt.profile import trace as T
from eqgpt.train import Strategy, TrainState, make_train_step

CONFIG = eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=4, embed_dim=32)
# Named scopes the model and step put on their ops (`jax.named_scope`); each must reach the trace.
SCOPES = ("block", "attention", "mlp", "loss", "optimizer")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    strategy = Strategy(par.make_mesh("fsdp=4,tensor=2"), "fsdp+tp")
    optimizer = optax.adamw(1e-3)
    model = strategy.init_model(lambda k: nn.GPT(CONFIG, key=k), jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(0))
    step = make_train_step(optimizer, strategy=strategy, model_like=model, donate=False)
    windows = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1)).astype(np.int32)
    batch = strategy.batch(Batch.from_windows(windows))
    compiled = step.lower(state, batch).compile({"xla_backend_optimization_level": 0})
    log_dir = tmp_path_factory.mktemp("trace")
    window = T.ProfileWindow(1, 3, log_dir)  # steps 1 and 2; step 0 warms up
    for i in range(4):
        state, metrics = window.run(i, compiled, state, batch)
    window.close()
    return log_dir, window, compiled


def test_trace_files_exist(traced):
    log_dir, window, _ = traced
    files = T.trace_files(log_dir)
    assert files["xplane"].stat().st_size > 0 and files["perfetto"].stat().st_size > 0
    assert window.memory_profile is not None and window.memory_profile.stat().st_size > 0
    assert not window.active


def test_trace_holds_named_scopes_and_collectives(traced):
    log_dir, _, compiled = traced
    raw = T.trace_files(log_dir)["xplane"].read_bytes()  # the traced program's HLO, with op names, is inside
    for scope in SCOPES:
        assert f"({scope})".encode() in raw or f"/{scope}/".encode() in raw, scope
    ops, steps = T.load_events(log_dir)
    assert [s.step for s in steps] == [1, 2]
    kinds = {T.collective_kind(o.name) for o in ops} - {None}
    assert {"all-gather", "all-reduce"} <= kinds, kinds  # FSDP gathers weights, TP reduces activations
    assert {o.device for o in ops} == set(range(8))
    table = T.op_table(log_dir, hlo_text=compiled, scopes=SCOPES)
    assert "loss" in table


def test_compute_and_communication_add_up_to_the_step(traced):
    log_dir, _, _ = traced
    steps = T.step_breakdown(log_dir)
    assert len(steps) == 2
    for s in steps:
        assert s.devices == 8
        assert s.rows["compute"] > 0 and s.communication_ns > 0
        assert sum(s.rows.values()) == pytest.approx(s.step_ns, rel=0.10)
    text = T.breakdown_table(log_dir)
    assert "comm: all-gather" in text and "step (annotation)" in text


def test_parse_steps():
    assert T.parse_steps("10:15") == (10, 15)
    assert T.parse_steps(None) is None
    with pytest.raises(ValueError, match="START:STOP"):
        T.parse_steps("15:10")
    with pytest.raises(ValueError, match="0 <= start < stop"):
        T.ProfileWindow(3, 3, "x")
