"""The MoE layer against the independent NumPy definitions (`tests/references.py`): the
load-balancing and router z-losses (`moe_loss`), the capacity drop rule, and the output.

fp32 against float64; the measured relative errors are at most 2.4e-7, so the tolerance
is rel 1e-5. A load-balancing loss off by `top_k` would be off by 100%.
"""

import equinox as eqx
import jax
import numpy as np
import pytest

import references as ref
from eqgpt.config import MoEConfig
from eqgpt.nn.moe import MoE, assign_slots, moe_loss
from helpers import assert_within, rel_err

B, T, D, F, E = 3, 12, 16, 8, 4
TOL = 1e-5


def layer(top_k, capacity_factor=1.0, dropless=False, seed=0):
    """An MoE layer whose router has unit-scale weights (so routing is far from uniform)."""
    kr, km = jax.random.split(jax.random.key(seed))
    moe = MoE(D, F, E, top_k=top_k, capacity_factor=capacity_factor, dropless=dropless, init_std=0.3, key=km)
    return eqx.tree_at(lambda m: m.router.weight, moe, jax.random.normal(kr, (D, E)))


def tokens(seed):
    return jax.random.normal(jax.random.key(100 + seed), (B, T, D))


def router_logits(moe, x):
    return np.asarray(x, np.float64) @ np.asarray(moe.router.weight, np.float64)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_loss_matches_switch_definition(top_k):
    """Two layers' statistics summed, as a model sums them, then `moe_loss`'s per-layer means."""
    moe = layer(top_k)
    xs = [tokens(0), tokens(1)]
    stats = [moe.with_stats(x)[1] for x in xs]
    total = jax.tree.map(lambda a, b: a + b, *stats)
    config = MoEConfig(num_experts=E, top_k=top_k, aux_loss_weight=0.3, router_z_weight=0.07)
    loss, metrics = moe_loss(total, config, rows=B, tokens=B * T)
    logits = [router_logits(moe, x) for x in xs]
    balance = np.mean([ref.load_balancing_loss(lg, top_k) for lg in logits])
    z = np.mean([ref.router_z_loss(lg) for lg in logits])
    assert_within(rel_err(metrics["moe_balance"], balance), TOL)
    assert_within(rel_err(metrics["moe_router_z"], z), TOL)
    assert_within(rel_err(loss, 0.3 * balance + 0.07 * z), TOL)
    if top_k == 1:  # Switch's own definition: the fraction of tokens whose argmax is e
        switch = np.mean([ref.load_balancing_loss(lg, 1, "top1") for lg in logits])
        assert_within(rel_err(metrics["moe_balance"], switch), TOL)


def test_routing_matches_top_k_of_the_router():
    moe = layer(2)
    x = tokens(0)
    _, _, top_e, _ = moe.route(x)
    np.testing.assert_array_equal(np.asarray(top_e), ref.top_k_experts(router_logits(moe, x), 2))


# (1, 1.2): ceil(1.2 x 12 / 4) = 4 slots, where rounding down would give 3.
@pytest.mark.parametrize("top_k,factor", [(1, 1.0), (2, 1.0), (2, 0.5), (1, 1.2)])
def test_capacity_drops_as_the_rule_says(top_k, factor):
    moe = layer(top_k, factor)
    x = tokens(2)
    c = ref.expert_capacity(T, E, top_k, factor)
    assert moe.capacity(T) == c == {(1, 1.0): 3, (2, 1.0): 6, (2, 0.5): 3, (1, 1.2): 4}[top_k, factor]  # by hand
    chosen = ref.top_k_experts(router_logits(moe, x), top_k)
    kept = ref.capacity_kept(chosen, E, c)
    assert not kept.all()  # the case drops something
    slot = np.asarray(assign_slots(jax.numpy.asarray(chosen), E, c))
    np.testing.assert_array_equal(slot != E * c, kept)
    y, stats = moe.with_stats(x)
    assert float(stats.dropped) == np.sum(~kept)
    want = ref.moe_output(x, moe.router.weight, moe.experts.up, moe.experts.down, top_k, kept)
    assert_within(np.max(np.abs(np.asarray(y) - want)) / np.max(np.abs(want)), TOL)


@pytest.mark.parametrize("dropless", [False, True], ids=["capacity", "dropless"])
def test_output_without_drops(dropless):
    """Capacity large enough to keep all (capacity path), and the dropless grouped matmul."""
    moe = layer(2, capacity_factor=float(E), dropless=dropless)
    x = tokens(3)
    y, stats = moe.with_stats(x)
    assert float(stats.dropped) == 0
    want = ref.moe_output(x, moe.router.weight, moe.experts.up, moe.experts.down, 2)
    assert_within(np.max(np.abs(np.asarray(y) - want)) / np.max(np.abs(want)), TOL)
