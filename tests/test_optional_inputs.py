"""The documented entry points with their optional inputs left out and given as the value the
default stands for: the same result. A default that meant something else (a mask of zeros, one
segment per token, positions from 1) shows here.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.nn.loss import lm_batch_loss
from eqgpt.precision import Policy
from eqgpt.train import Strategy
from eqgpt.train.trainer import Trainer, TrainerConfig, make_eval_fn
from helpers import TINY, TINY_LLAMA, unchecked

ROWS, SEQ = 2, 12


def windows(seed=0):
    return np.asarray(jax.random.randint(jax.random.key(seed), (ROWS, SEQ + 1), 0, 64), np.int32)


def defaults_given(b: Batch) -> Batch:
    """`b` with every optional field as the value its absence stands for."""
    return Batch(b.tokens, b.targets, loss_mask=np.ones((ROWS, SEQ), np.float32),
                 segment_ids=np.ones((ROWS, SEQ), np.int32), positions=np.tile(np.arange(SEQ, dtype=np.int32),
                                                                               (ROWS, 1)))


@pytest.mark.parametrize("config", [TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_model_and_loss_with_defaults_left_out_or_given(config):
    model = nn.GPT(config, key=jax.random.key(0))
    b = Batch.from_windows(windows())
    full = defaults_given(b)
    logits = jax.jit(lambda m, t: m(t))(model, b.tokens)
    given = jax.jit(lambda m, t, s, p: m(t, positions=jnp.arange(SEQ), segment_ids=s, doc_positions=p))(
        model, full.tokens, full.segment_ids, full.positions)
    np.testing.assert_allclose(given, logits, rtol=1e-5, atol=1e-6)
    loss_fn = jax.jit(lambda m, x: lm_batch_loss(m, x, chunk_size=5))  # 12 positions: a padded last chunk
    (plain, _), (full_loss, _) = loss_fn(model, b), loss_fn(model, full)
    np.testing.assert_allclose(full_loss, plain, rtol=1e-6)
    direct, _ = nn.lm_loss(model, jnp.asarray(b.tokens), jnp.asarray(b.targets))
    np.testing.assert_allclose(direct, plain, rtol=1e-6)


def test_batch_from_windows_leaves_its_options_out():
    w = windows()
    b = Batch.from_windows(w)
    np.testing.assert_array_equal(b.tokens, w[:, :-1])
    np.testing.assert_array_equal(b.targets, w[:, 1:])
    assert b.loss_mask is None and b.segment_ids is None and b.positions is None
    assert b.shape == (ROWS, SEQ) and b.rows(1, 2).shape == (1, SEQ)


def test_eval_fn_and_validation_with_and_without_their_options():
    model = nn.GPT(TINY, key=jax.random.key(1))
    b = Batch.from_windows(jnp.asarray(windows(2)))
    want = float(Strategy().loss_fn()(model, b)[0])
    assert float(make_eval_fn()(model, b)) == pytest.approx(want, rel=1e-6)
    assert float(make_eval_fn(Strategy().loss_fn(), Policy())(model, b)) == pytest.approx(want, rel=1e-6)
    bf16 = float(make_eval_fn(policy=Policy.named("bf16"))(model, b))
    assert bf16 == pytest.approx(want, rel=2e-2) and bf16 != want  # computed in bf16, returned in fp32

    class OneDevice:
        batch_divisor = 1

        def batch(self, x):
            return x

    def trainer(**kw):  # for its validation alone: no step, state or loader
        with unchecked():
            return Trainer(None, None, None, OneDevice(), config=TrainerConfig(steps=1, progress=False), **kw)

    assert trainer().validate(model) is None  # no validation windows: nothing to report
    assert trainer(val_windows=windows(2)).validate(model) == pytest.approx(want, rel=1e-6)


def test_a_batch_of_all_masked_positions_has_zero_loss():
    """A batch whose mask counts nothing (a padded last batch of one device) adds nothing: loss 0,
    gradients 0, not NaN."""
    model = nn.GPT(TINY, key=jax.random.key(3))
    b = Batch.from_windows(windows(4))
    empty = Batch(b.tokens, b.targets, loss_mask=np.zeros((ROWS, SEQ), np.float32))
    (loss, _), grads = eqx.filter_jit(Strategy().grad_fn())(model, empty)
    assert float(loss) == 0.0
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array)))
