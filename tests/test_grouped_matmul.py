"""The grouped matmul kernels (Pallas megablox in interpret mode on CPU, ragged_dot) against
a loop over groups written here: values and gradients, uneven and empty groups, rows that
are not a multiple of the kernel's tile, and inside a type-checked shard_map."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.nn.kernels.grouped import auto_grouped_kernel, grouped_matmul

SIZES = np.array([37, 0, 90, 73], np.int32)  # 200 rows: not a multiple of 128; one empty group


def loop_definition(x, w, sizes):
    """Each group's rows times its matrix, one group at a time."""
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return jnp.concatenate([x[starts[e]:starts[e + 1]] @ w[e] for e in range(len(sizes))])


def operands(k=96, n=160):
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    m = int(SIZES.sum())
    return (jax.random.normal(kx, (m, k)), jax.random.normal(kw, (len(SIZES), k, n)) / 10,
            jax.random.normal(kc, (m, n)))


@pytest.mark.parametrize("kernel", ["megablox", "ragged_dot"])
def test_grouped_matmul_equals_the_loop_values_and_gradients(kernel):
    x, w, ct = operands()
    sizes = jnp.asarray(SIZES)
    got = jax.value_and_grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, kernel=kernel) * ct),
                             argnums=(0, 1))(x, w)
    want = jax.value_and_grad(lambda x, w: jnp.sum(loop_definition(x, w, SIZES) * ct), argnums=(0, 1))(x, w)
    # fp32: measured differences <= 2e-6 of the largest value
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_megablox_inside_a_shard_map_that_checks_types():
    """Rows split over `data`, the weights invariant: their gradient is summed over `data`."""
    from jax.sharding import PartitionSpec as P

    from eqgpt.parallel.mesh import make_mesh

    mesh = make_mesh("data=8")
    x, w, _ = operands()
    xs = jnp.concatenate([x] * 8)
    sizes = jnp.asarray(SIZES)
    mapped = jax.shard_map(lambda x, w: grouped_matmul(x, w, sizes, kernel="megablox"), mesh=mesh,
                           in_specs=(P("data"), P()), out_specs=P("data"), axis_names={"data"})
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(mapped(x, w) ** 2), argnums=(0, 1)))(xs, w)
    want = jax.grad(lambda x, w: 8 * jnp.sum(loop_definition(x, w, SIZES) ** 2), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want[1]))))
    np.testing.assert_allclose(np.asarray(got[0][: len(x)]), np.asarray(want[0]) / 8, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want[0]))))


def test_auto_picks_megablox_on_tpu_outside_an_automatic_mesh():
    from eqgpt.parallel.mesh import make_mesh

    assert auto_grouped_kernel("tpu") == "megablox"
    assert auto_grouped_kernel("cpu") == auto_grouped_kernel("gpu") == "ragged_dot"
    with jax.sharding.use_abstract_mesh(make_mesh("data=8").abstract_mesh):
        assert auto_grouped_kernel("tpu") == "ragged_dot"  # GSPMD cannot split a Pallas call
    with pytest.raises(ValueError, match="Unknown grouped matmul kernel"):
        grouped_matmul(*operands()[:2], jnp.asarray(SIZES), kernel="gmm")
