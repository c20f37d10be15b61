"""Training: loss goes down, accumulation == big batch, the non-finite guard, decay mask, FLOPs."""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eqgpt.data import Batch, BatchLoader
from eqgpt.nn import GPT
from eqgpt.nn.loss import lm_batch_loss
from eqgpt.profile.flops import flops_per_token, matmul_params
from eqgpt.train import (
    Policy,
    SingleDevice,
    Strategy,
    TrainState,
    decay_mask,
    eval_batches,
    load_model,
    make_lr_schedule,
    make_optimizer,
    make_train_step,
    save_model,
)
from helpers import TINY, assert_trees_close, unchecked


def init(optimizer, config=TINY, seed=0):
    placement = SingleDevice()
    model = placement.init_model(lambda k: GPT(config, key=k), jax.random.key(seed))
    return TrainState(model, placement.init_opt_state(optimizer, model), rng=jax.random.key(1))


def host(state):
    return jax.tree.map(np.asarray, eqx.filter((state.model, state.opt_state), eqx.is_array))


# One optimizer and one compiled step shared by the tests below (compiling is the slow part).
OPT = make_optimizer(make_lr_schedule(3e-3, total_steps=30, warmup_steps=3))
STEP = make_train_step(OPT)


def batch_of(seed, rows=8):
    return Batch.from_windows(jax.random.randint(jax.random.key(seed), (rows, 33), 0, TINY.vocab_size))


def test_loss_goes_down_over_30_steps():
    state = init(OPT)
    pattern = np.tile(np.arange(17) % 13, 64)  # a learnable periodic sequence
    loader = BatchLoader(pattern.astype(np.uint16), batch_size=8, seq_len=32, seed=0)
    losses = []
    for s in range(30):
        state, m = STEP(state, SingleDevice().batch(loader.local_batch(s)))
        losses.append(float(m["loss"]))
    assert int(state.step) == 30 and int(state.skipped) == 0
    assert losses[-1] < 0.7 * losses[0], losses


def test_accumulation_equals_one_big_batch():
    # SGD keeps the update linear in the gradient, so the comparison is not blurred by
    # Adam's sign-like first steps on near-zero gradients.
    opt = optax.sgd(0.5)
    big, micro = init(opt), init(opt)
    one, four = make_train_step(opt, accum_steps=1), make_train_step(opt, accum_steps=4)
    for seed in range(3):
        big, mb = one(big, batch_of(seed))
        micro, mm = four(micro, batch_of(seed))
        np.testing.assert_allclose(float(mb["loss"]), float(mm["loss"]), rtol=1e-6)
        np.testing.assert_allclose(float(mb["grad_norm"]), float(mm["grad_norm"]), rtol=1e-5)
    assert_trees_close(eqx.filter(big.model, eqx.is_array), eqx.filter(micro.model, eqx.is_array),
                       rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="divisible by accum_steps"):
        make_train_step(opt, accum_steps=3)(micro, batch_of(0))


def test_nonfinite_guard_skips_update_and_counts():
    state = init(OPT)
    state, _ = STEP(state, batch_of(0))  # one good step so the optimizer state is non-trivial
    # Poison one weight: the loss and the gradients become NaN.
    poisoned = eqx.tree_at(lambda m: m.norm.weight, state.model, state.model.norm.weight.at[0].set(jnp.nan))
    state = TrainState(poisoned, state.opt_state, state.step, rng=state.rng, skipped=state.skipped)
    before = host(state)
    state, m = STEP(state, batch_of(1))
    assert int(m["skipped"]) == 1 and int(state.skipped) == 1 and int(state.step) == 2
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(host(state)), strict=True):
        np.testing.assert_array_equal(x, y)  # bit-identical (NaN where it was NaN)


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_a_non_finite_gradient_under_a_finite_loss_skips_the_update(bad):
    """The guard reads the gradients' global norm: one bad entry of one leaf drops the update."""
    state = init(OPT)
    state, _ = STEP(state, batch_of(0))
    good = eqx.filter_value_and_grad(lm_batch_loss, has_aux=True)

    def grad_fn(model, batch):
        loss_and_aux, grads = good(model, batch)
        return loss_and_aux, eqx.tree_at(lambda g: g.norm.weight, grads, replace_fn=lambda w: w.at[0].set(bad))

    before = host(state)
    state, m = make_train_step(OPT, grad_fn=grad_fn, donate=False)(state, batch_of(1))
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    assert int(m["skipped"]) == 1 and int(state.skipped) == 1 and int(state.step) == 2
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(host(state)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_decay_mask_from_module_structure():
    model = GPT(TINY.replace(tie_embeddings=False), key=jax.random.key(0))
    mask = decay_mask(eqx.filter(model, eqx.is_array))
    assert mask.blocks.attn.q_proj.weight is True and mask.blocks.mlp.down.weight is True
    assert mask.head.weight is True
    assert mask.blocks.attn.q_proj.bias is False and mask.blocks.attn_norm.weight is False
    assert mask.tok_embed.weight is False and mask.pos_embed.weight is False and mask.norm.bias is False
    everything = decay_mask(model, embeddings=True, norms_and_biases=True)
    assert all(jax.tree.leaves(everything))
    # The mask fits the optimizer: with zero gradients, weight decay alone moves only decayed arrays.
    opt = make_optimizer(1.0, weight_decay=0.5, clip_norm=None)
    params = eqx.filter(model, eqx.is_array)
    zero_grads = lambda m, b: ((jnp.float32(0), {}), jax.tree.map(jnp.zeros_like, params))  # noqa: E731
    state = TrainState(model, opt.init(params), rng=jax.random.key(0))
    after, _ = make_train_step(opt, grad_fn=zero_grads, donate=False)(state, batch_of(0, rows=1))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), eqx.filter(after.model, eqx.is_array), params)
    assert jax.tree.leaves(moved) == jax.tree.leaves(mask)


def test_schedule_and_bad_settings():
    s = make_lr_schedule(1.0, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert float(s(0)) == 0.0 and float(s(10)) == pytest.approx(1.0) and float(s(100)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_lr_schedule(1.0, total_steps=10, warmup_steps=10)
    with pytest.raises(ValueError, match="accum_steps"):
        make_train_step(optax.sgd(1.0), accum_steps=0)
    with pytest.raises(ValueError, match="choose"):
        Policy(compute_dtype="int8")
    with pytest.raises(ValueError, match="not both"):  # a policy would be silently ignored
        make_train_step(optax.sgd(1.0), grad_fn=Strategy().grad_fn(), policy=Policy())
    with pytest.raises(ValueError, match=r"\[batch, seq \+ 1\]"), unchecked():
        Batch.from_windows(np.zeros((4,), np.int32))
    with pytest.raises(ValueError, match="every field"), unchecked():
        Batch(np.zeros((2, 4), np.int32), np.zeros((2, 5), np.int32))


def test_batch_is_the_shifted_windows_and_validation_pads_to_the_mesh():
    windows = np.arange(2 * 5, dtype=np.int32).reshape(2, 5)
    b = Batch.from_windows(windows)
    np.testing.assert_array_equal(b.tokens, windows[:, :-1])
    np.testing.assert_array_equal(b.targets, windows[:, 1:])
    # 3 windows on a batch split 4 ways: one batch of 4 rows, the 4th masked out.
    (padded, real), = eval_batches(np.tile(windows, (2, 1))[:3], batch_size=16, divisor=4)
    assert padded.shape == (4, 4) and real == 3 * 4
    np.testing.assert_array_equal(padded.loss_mask.sum(axis=1), [4, 4, 4, 0])
    # 20 windows in batches of 16: the last is padded to 16 rows too (one eval program), 4 of them real.
    batches = eval_batches(np.tile(windows, (10, 1)), batch_size=16, divisor=1)
    assert [(b.shape, real) for b, real in batches] == [((16, 4), 64), ((16, 4), 16)]
    # The masked mean over the padded batch is the mean over the real rows.
    model = GPT(TINY.replace(seq_len=4), key=jax.random.key(0))
    loss_fn = eqx.filter_jit(Strategy().loss_fn())
    np.testing.assert_allclose(float(loss_fn(model, padded)[0]),
                               float(loss_fn(model, Batch.from_windows(np.tile(windows, (2, 1))[:3]))[0]), rtol=1e-6)


def test_bf16_policy_keeps_fp32_params_and_grads():
    model = GPT(TINY, key=jax.random.key(0))
    policy = Policy.named("bf16")
    assert all(x.dtype == jnp.bfloat16
               for x in jax.tree.leaves(eqx.filter(policy.cast_to_compute(model), eqx.is_inexact_array)))
    (loss, _), grads = eqx.filter_jit(Strategy().grad_fn(policy))(model, batch_of(0, rows=2))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array)))
    assert Policy.default("cpu").compute_dtype == "fp32" and Policy.default("gpu").compute_dtype == "bf16"


def test_flops_formula():
    c = TINY  # L=2, D=32, F=128, V=64, T=32
    assert matmul_params(c) == 2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 64
    assert flops_per_token(c) == 6 * matmul_params(c) + 6 * 2 * 32 * 32


def test_export_round_trip(tmp_path):
    model = GPT(TINY, key=jax.random.key(0))
    save_model(tmp_path, model)
    loaded = load_model(tmp_path)
    assert loaded.config == TINY
    assert_trees_close(eqx.filter(model, eqx.is_array), eqx.filter(loaded, eqx.is_array), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not found"):
        load_model(tmp_path / "nothing")


def test_loss_plot_is_optional(tmp_path, monkeypatch, capsys):
    from eqgpt.train.trainer import History, plot_history

    history = History([{"step": 0, "loss": 5.0, "val_loss": 5.1}, {"step": 1, "loss": 4.0}])
    assert plot_history(history, tmp_path / "with.png") == tmp_path / "with.png"
    assert (tmp_path / "with.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert plot_history(history, tmp_path / "without.png") is None
    assert not (tmp_path / "without.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_loss_plot_is_one_axis_with_one_legend_and_bits_per_byte_in_the_title():
    import matplotlib.pyplot as plt

    from eqgpt.train.plot import loss_figure
    from eqgpt.train.trainer import History

    rows = [{"step": s, "loss": 5.5 * 0.9 ** s} for s in range(40)]  # a resumed run: rows from both segments
    rows += [{"step": s, "val_loss": 5.4 * 0.9 ** s, "val_bpb": 7.0 * 0.9 ** s} for s in (0, 20, 39)]
    fig = loss_figure(History(rows), title="nano")
    (ax,) = fig.axes
    assert ax.get_legend() is not None and not fig.legends
    assert ax.get_yscale() == "log" and "nats" in ax.get_ylabel()
    assert "bits/byte" in ax.get_title() and ax.get_title().startswith("nano")
    train, val = ax.get_lines()
    assert list(train.get_xdata()) == list(range(40)) and list(val.get_xdata()) == [0, 20, 39]
    assert val.get_linestyle() == "None"  # evaluations are points, not joined by straight lines
    plt.close(fig)
