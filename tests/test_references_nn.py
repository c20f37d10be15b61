"""RoPE, the norms and global-norm clipping against NumPy definitions written from the papers.

- RoPE (Su et al. 2021, RoFormer), in the rotate-half pairing of GPT-NeoX and Llama: pair
  `i < d/2` is `(x[i], x[i + d/2])`, rotated by `p * theta^(-2i/d)` at position `p`.
- LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), with `eps` inside the
  square root; inputs of variance 1e-6, so that `eps` (1e-3 here) dominates it.
- Clipping by the global norm (Pascanu et al. 2013): `g * min(1, c / ||g||)`, and bitwise
  optax's scaling; the learning-rate schedule's defaults (its every step: `test_properties`).

fp32 against float64: the measured errors are at most 4.4e-7 (RoPE at positions up to 100;
at 1000 fp32's rounding of the angle alone reaches 9e-6), so the tolerance is 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import references as ref
from eqgpt import nn
from eqgpt.nn.rope import apply_rope, rope_angles
from eqgpt.parallel import Part, Strategy
from eqgpt.train.optim import clip_by_global_norm, make_lr_schedule
from helpers import assert_within, rel_err

TOL = 1e-5


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_is_the_rotation_of_each_pair(theta):
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 6, 3, 16)))
    positions = np.array([0, 1, 2, 7, 30, 100])
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions), theta)
    assert_within(rel_err(got, ref.rope(x, positions, theta)), TOL)


def test_rope_defaults_to_theta_ten_thousand_and_needs_an_even_head_dim():
    x = np.asarray(jax.random.normal(jax.random.key(3), (1, 4, 2, 8)))
    positions = np.array([0, 3, 100, 900])  # at 900 a base of 10001 turns the second pair 2e-3 rad less
    assert_within(rel_err(apply_rope(jnp.asarray(x), jnp.asarray(positions)), ref.rope(x, positions, 10000.0)),
                  TOL)
    cos, sin = rope_angles(jnp.asarray(positions), 8)
    angle = positions[:, None] * 10000.0 ** (-2.0 * np.arange(4) / 8)
    np.testing.assert_allclose(cos, np.cos(angle), atol=2e-5)
    np.testing.assert_allclose(sin, np.sin(angle), atol=2e-5)
    assert apply_rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions)).dtype == jnp.bfloat16  # x's dtype
    with pytest.raises(ValueError, match="RoPE needs an even head_dim, got 7"):
        rope_angles(jnp.arange(3), 7)


def test_rope_at_position_one_turns_the_first_pair_by_one_radian():
    """A hand-worked case: the first pair's frequency is theta^0 = 1."""
    x = np.zeros((1, 2, 1, 4), np.float32)
    x[..., 0] = 1.0  # the pair (x[0], x[2]) = (1, 0)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.arange(2), 10000.0))
    np.testing.assert_allclose(got[0, 1, 0, [0, 2]], [np.cos(1.0), np.sin(1.0)], rtol=1e-6)
    np.testing.assert_allclose(got[0, 0, 0], x[0, 0, 0])


def test_norms_with_an_eps_that_matters():
    x = np.asarray(jax.random.normal(jax.random.key(1), (3, 8))) * 1e-3 + 2e-3
    x64, eps = x.astype(np.float64), 1e-3
    centred = x64 - x64.mean(-1, keepdims=True)
    layer = centred / np.sqrt(centred.var(-1, keepdims=True) + eps)
    rms = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + eps)
    assert_within(rel_err(nn.LayerNorm(8, eps=eps)(jnp.asarray(x)), layer), TOL, "LayerNorm")
    assert_within(rel_err(nn.RMSNorm(8, eps=eps)(jnp.asarray(x)), rms), TOL, "RMSNorm")


def stepped(clip, grads, norm=None, after=None):
    """Minus the update one `make_train_step` applies with `chain(clip, after, sgd(1))` to zero
    parameters whose gradients are `grads`: the clipped gradients, as the trainer's optimizer stage
    makes them (`after`, if given, transforms them first; `norm`, if given, is the norm a strategy
    part hands the update, as ZeRO hands its block norm)."""
    from eqgpt.data.batch import Batch
    from eqgpt.train import TrainState, make_train_step

    params = jax.tree.map(jnp.zeros_like, grads)
    optimizer = optax.chain(clip, *([after] if after else []), optax.sgd(1.0))
    step = make_train_step(optimizer, strategy=Strategy(parts=(GivenGradients(grads, norm),)), donate=False)
    state, _ = step(TrainState(params, optimizer.init(params), rng=jax.random.key(0)),
                    Batch.from_windows(np.zeros((1, 2), np.int32)))
    return jax.tree.map(jnp.negative, state.model)


class GivenGradients(Part):
    """A part whose gradients are `grads` and whose optimizer update, given a `norm`, reads it
    through `norm_fn` (the optax extra argument ZeRO's update passes)."""

    name = "given-gradients"
    needs_mesh = False

    def __init__(self, grads, norm: float | None = None):
        self.grads, self.norm = grads, norm

    def grad_fn(self, strategy, policy, **_):
        return lambda model, batch: ((jnp.float32(0), {}), self.grads)

    def update(self, strategy, update):
        if self.norm is None:
            return update
        return lambda *args, **extra: update(*args, **extra, norm_fn=lambda tree: jnp.float32(self.norm))


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clips", "passes"])
def test_clip_by_global_norm(max_norm):
    keys = jax.random.split(jax.random.key(2), 3)
    grads = {"a": jax.random.normal(keys[0], (4, 5)),
             "b": [jax.random.normal(keys[1], (7,)), jax.random.normal(keys[2], ())]}
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    norm = np.sqrt(sum(np.sum(g**2) for g in leaves))
    want = [g * min(1.0, max_norm / norm) for g in leaves]
    for g, w in zip(jax.tree.leaves(stepped(clip_by_global_norm(max_norm), grads)), want, strict=True):
        assert_within(rel_err(g, w), TOL, "clipped gradient")


@pytest.mark.parametrize("max_norm", [37.0, 10.0, 100.0], ids=["at-the-norm", "clips", "passes"])
def test_clip_scales_as_optax_does_and_reads_the_norm_it_is_given(max_norm):
    """Through the training step, bitwise optax's scaling (the docstring's promise), also where the
    norm equals `max_norm` exactly (|(12, 35)| = 37: optax scales by 37/37, which rounds 12 to
    11.999999). The norm comes from `norm_fn` when a strategy part's update gives one (ZeRO's block
    norm; its training parity is test_gradient_parity's), the state is optax's, and gradients keep their
    dtype."""
    grads = {"a": jnp.asarray([12.0, 35.0]), "b": jnp.zeros((2,))}
    ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    for g, w in zip(jax.tree.leaves(stepped(ours, grads)), jax.tree.leaves(stepped(theirs, grads)), strict=True):
        np.testing.assert_array_equal(g, w)
    halved = stepped(ours, grads, norm=2 * max_norm)
    np.testing.assert_allclose(halved["a"], [6.0, 17.5], rtol=1e-6)
    assert ours.init(grads) == theirs.init(grads)  # the same (empty) state: checkpoints stay interchangeable
    low = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)
    # The stage after the clip turns each gradient into 1 where it is still bf16 (dtypes are static).
    kept = optax.stateless(lambda u, p: jax.tree.map(lambda g: jnp.full_like(g, g.dtype == jnp.bfloat16), u))
    assert all(np.all(np.asarray(g) == 1) for g in jax.tree.leaves(stepped(ours, low, after=kept)))  # dtype kept


def test_schedule_defaults_and_bad_settings():
    """By default no warmup (the peak at step 0) and a floor of a tenth of the peak."""
    schedule = make_lr_schedule(2.0, total_steps=10)
    assert float(schedule(0)) == pytest.approx(2.0) and float(schedule(10)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="total_steps must be positive, got 0"):
        make_lr_schedule(1.0, total_steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps \(5\) must lie in \[0, total_steps=5\)"):
        make_lr_schedule(1.0, total_steps=5, warmup_steps=5)
