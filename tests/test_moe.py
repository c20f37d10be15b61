"""The MoE layer against its dense reading: a loop over experts in plain JAX."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqgpt
from eqgpt.nn.mlp import gelu_tanh
from eqgpt.nn.moe import MoE, assign_slots
from helpers import TINY, assert_trees_close

E, D, F, B, T = 4, 16, 24, 3, 10


def choices(moe: MoE, x):
    """Each token's top-k experts, in float64 NumPy."""
    logits = np.asarray(x, np.float64) @ np.asarray(moe.router.weight, np.float64)
    return np.argsort(-logits, axis=-1, kind="stable")[..., : moe.top_k]


def dense_reading(moe: MoE, x, top_e, keep=None):
    """Every token through each of its `top_e` experts, weighted; one expert at a time."""
    w = jnp.take_along_axis(jax.nn.softmax(x @ moe.router.weight, axis=-1), jnp.asarray(top_e), -1)
    if moe.renormalize and moe.top_k > 1:
        w = w / w.sum(-1, keepdims=True)
    keep = np.ones(top_e.shape, bool) if keep is None else keep
    ex = moe.experts
    y = jnp.zeros_like(x)
    for e in range(moe.num_experts):
        u = x @ ex.up[e]
        h = jax.nn.silu(x @ ex.gate[e]) * u if ex.gate is not None else gelu_tanh(u)
        coef = jnp.sum(jnp.where((top_e == e) & keep, w, 0.0), axis=-1)
        y = y + coef[..., None] * (h @ ex.down[e])
    return y + (moe.shared(x) if moe.shared is not None else 0.0)


def expected_keep(top_e, capacity):
    """The documented rule: choice rank first, then sequence position, until capacity."""
    b, t, k = top_e.shape
    keep = np.zeros(top_e.shape, bool)
    for row in range(b):
        used = {}
        for rank in range(k):
            for pos in range(t):
                e = int(top_e[row, pos, rank])
                if used.get(e, 0) < capacity:
                    keep[row, pos, rank] = True
                    used[e] = used.get(e, 0) + 1
    return keep


def gpt(cfg):
    """`GPT(cfg)` built in one program (eager, its initialisation compiles op by op)."""
    return eqx.filter_jit(lambda k: eqgpt.nn.GPT(cfg, key=k))(jax.random.key(0))


def make(key, **kw):
    moe = MoE(D, F, E, key=key, init_std=0.3, **kw)
    return moe, jax.random.normal(jax.random.fold_in(key, 1), (B, T, D))


@pytest.mark.parametrize("kw", [
    dict(top_k=1, capacity_factor=float(E)),
    dict(top_k=2, capacity_factor=float(E), kind="swiglu", num_shared=1),
    dict(top_k=3, dropless=True),
    dict(top_k=2, dropless=True, kind="swiglu", renormalize=False),
], ids=["k1", "k2-swiglu-shared", "k3-dropless", "k2-dropless-swiglu-raw"])
def test_moe_equals_dense_reading(kw):
    moe, x = make(jax.random.key(0), **kw)
    assert moe.capacity(T) == T  # nothing can drop
    # Jitted: one program each, not a compile per eager op (the dense reading is a loop of them).
    y, stats = eqx.filter_jit(MoE.with_stats)(moe, x)
    top_e = choices(moe, x)
    np.testing.assert_array_equal(eqx.filter_jit(MoE.route)(moe, x)[2], top_e)
    np.testing.assert_allclose(y, eqx.filter_jit(dense_reading)(moe, x, top_e), rtol=1e-5, atol=1e-6)
    assert float(stats.dropped) == 0 and float(stats.load.sum()) == B * T * moe.top_k
    r = jax.random.normal(jax.random.key(2), y.shape)
    loss = lambda m, x_, f: jnp.sum(f(m, x_) * r)  # noqa: E731
    params, rest = eqx.partition(moe, eqx.is_inexact_array)
    gl = jax.jit(jax.grad(lambda p, x_: loss(eqx.combine(p, rest), x_, lambda m, v: m(v)), argnums=(0, 1)))(params, x)
    gr = jax.jit(jax.grad(lambda p, x_: loss(eqx.combine(p, rest), x_, lambda m, v: dense_reading(m, v, top_e)),
                          argnums=(0, 1)))(params, x)
    # Gradients reach ~20 here: fp32 sums of that size round at ~1e-6, whatever the order XLA picks.
    assert_trees_close(gl, gr, rtol=1e-5, atol=5e-6)


def test_dropped_tokens_follow_the_rule():
    moe, x = make(jax.random.key(3), top_k=2, capacity_factor=0.5)
    c = moe.capacity(T)
    assert c == 3  # ceil(0.5 * 10 * 2 / 4)
    _, _, top_e, _ = eqx.filter_jit(MoE.route)(moe, x)
    slot = np.asarray(jax.jit(assign_slots, static_argnums=(1, 2))(top_e, E, c))
    keep = expected_keep(np.asarray(top_e), c)
    np.testing.assert_array_equal(slot != E * c, keep)
    assert not keep.all()
    y, stats = eqx.filter_jit(MoE.with_stats)(moe, x)
    assert float(stats.dropped) == (~keep).sum()
    np.testing.assert_allclose(y, eqx.filter_jit(dense_reading)(moe, x, np.asarray(top_e), keep), rtol=1e-5, atol=1e-6)


def test_moe_model_loss_has_aux_terms_and_metrics():
    cfg = TINY.replace(moe=eqgpt.MoEConfig(num_experts=4, top_k=2, expert_dim=32))
    model = gpt(cfg)
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    loss, aux = eqx.filter_jit(eqgpt.nn.lm_loss)(model, tok, tok)
    extra = cfg.moe.aux_loss_weight * aux["moe_balance"] + cfg.moe.router_z_weight * aux["moe_router_z"]
    np.testing.assert_allclose(loss, aux["nll"] + extra, rtol=1e-6)
    assert aux["moe_load"].shape == (4,) and abs(float(aux["moe_load"].sum()) - 1) < 1e-6


@pytest.mark.parametrize("field, value, match", [
    ("top_k", 5, "top_k"), ("capacity_factor", 0.0, "capacity_factor"), ("num_experts", 0, "num_experts"),
])
def test_moe_config_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        eqgpt.MoEConfig(**{"num_experts": 4, field: value})


def test_every_nth_layer_is_moe_and_decodes_like_the_forward():
    cfg = TINY.replace(num_layers=4, moe=eqgpt.MoEConfig(num_experts=4, top_k=1, every=2, capacity_factor=4.0))
    model = gpt(cfg)
    first, second = model.blocks.layers
    assert not isinstance(first.mlp, MoE) and isinstance(second.mlp, MoE)
    assert second.mlp.experts.up.shape[0] == 2  # two groups of (dense, MoE)
    tok = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    _, aux = eqx.filter_jit(eqgpt.nn.lm_loss)(model, tok, tok)
    assert abs(float(aux["moe_load"].sum()) - 1) < 1e-6
    logits, _ = eqx.filter_jit(lambda m, t: m.decode(t, m.init_cache(2, 16), 0))(model, tok)
    np.testing.assert_allclose(logits, eqx.filter_jit(lambda m, t: m(t))(model, tok), rtol=1e-5, atol=1e-5)


def test_dropless_dispatch_differentiates_into_gathers_not_scatters():
    moe, x = make(jax.random.key(0), top_k=2, dropless=True)
    params, rest = eqx.partition(moe, eqx.is_inexact_array)
    grad = jax.grad(lambda p, x_: jnp.sum(eqx.combine(p, rest)(x_) ** 2), argnums=(0, 1))
    text = str(jax.make_jaxpr(grad)(params, x))
    assert "gather" in text and "scatter" not in text  # accelerators serialise a scatter-add
