"""Each collective on 8 devices equals its NumPy definition, and its gradient equals
`jax.grad` of the same definition run densely (jnp) on the global array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqgpt.parallel import collectives as C
from helpers import unchecked

N = 8
K, M = 2, 3  # local block [K, M]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,))


def blocks(xp, X, rows):
    """Global `[N*rows, M]` -> `[N, rows, M]`: block i is what device i holds."""
    return X.reshape(N, rows, *X.shape[1:])


# Each case: (name, local fn, in_spec, out_spec, global input rows, dense definition(xp, X)).
# A varying result is returned with out_spec P("x"): the global output stacks every
# device's copy, so the dense definition says what each device holds.
PERM = [(0, 3), (3, 5), (5, 0), (1, 2)]


def _ppermute_dense(xp, X):
    b = blocks(xp, X, K)
    out = [xp.zeros_like(b[0])] * N
    for s, d in PERM:
        out[d] = b[s]
    return xp.concatenate(out)


def _gather_dense(xp, X, root=6):
    return xp.concatenate([X if i == root else xp.zeros_like(X) for i in range(N)])


def _all_to_all_dense(xp, X):
    # local [N*a, b] split on rows into N blocks; device j gets block j of every device, on columns.
    a = 1
    b5 = X.reshape(N, N, a, M)  # [device i, block j, a, b]
    return b5.transpose(1, 2, 0, 3).reshape(N * a, N * M)  # device j: [a, (i, b)]


CASES = [
    ("all_reduce_sum", lambda x: C.all_reduce(x, "x"), P("x"), P(), N * K,
     lambda xp, X: blocks(xp, X, K).sum(0)),
    ("all_reduce_mean", lambda x: C.all_reduce(x, "x", op="mean"), P("x"), P(), N * K,
     lambda xp, X: blocks(xp, X, K).mean(0)),
    ("all_gather_dim0", lambda x: C.all_gather(x, "x"), P("x"), P("x"), N * K,
     lambda xp, X: xp.concatenate([X] * N)),
    ("all_gather_dim1", lambda x: C.all_gather(x, "x", dim=1), P("x"), P("x"), N * K,
     lambda xp, X: xp.concatenate([xp.concatenate(list(blocks(xp, X, K)), axis=1)] * N)),
    ("all_gather_stacked", lambda x: C.all_gather(x, "x", tiled=False), P("x"), P("x"), N * K,
     lambda xp, X: xp.concatenate([blocks(xp, X, K)] * N)),
    ("reduce_scatter", lambda x: C.reduce_scatter(x, "x"), P("x"), P("x"), N * N * K,
     lambda xp, X: blocks(xp, X, N * K).sum(0)),
    ("broadcast_root3", lambda x: C.broadcast(x, "x", root=3), P("x"), P(), N * K,
     lambda xp, X: blocks(xp, X, K)[3]),
    ("broadcast_root0", lambda x: C.broadcast(x, "x", root=0), P("x"), P(), N * K,
     lambda xp, X: blocks(xp, X, K)[0]),
    ("scatter_root5", lambda x: C.scatter(x, "x", root=5), P("x"), P("x"), N * N * K,
     lambda xp, X: blocks(xp, X, N * K)[5]),
    ("scatter_root0", lambda x: C.scatter(x, "x", root=0), P("x"), P("x"), N * N * K,
     lambda xp, X: blocks(xp, X, N * K)[0]),
    ("gather_root6", lambda x: C.gather(x, "x", root=6), P("x"), P("x"), N * K, _gather_dense),
    ("gather_root0", lambda x: C.gather(x, "x", root=0), P("x"), P("x"), N * K,
     lambda xp, X: _gather_dense(xp, X, root=0)),
    ("ppermute", lambda x: C.ppermute(x, "x", PERM), P("x"), P("x"), N * K, _ppermute_dense),
    ("ring_shift_2", lambda x: C.ring_shift(x, "x", shift=2), P("x"), P("x"), N * K,
     lambda xp, X: xp.concatenate(list(xp.roll(blocks(xp, X, K), 2, axis=0)))),
    ("ring_shift_back", lambda x: C.ring_shift(x, "x", shift=-1), P("x"), P("x"), N * K,
     lambda xp, X: xp.concatenate(list(xp.roll(blocks(xp, X, K), -1, axis=0)))),
    ("all_to_all", lambda x: C.all_to_all(x, "x", split_dim=0, concat_dim=1), P("x"), P("x"),
     N * N, _all_to_all_dense),
]


OPTIONS = {"xla_backend_optimization_level": 0}  # as parallel_cases: same HLO, faster compile


@pytest.fixture(scope="module")
def results(mesh):
    """Every case's value and gradient, sharded and dense, from three compiled programs in all."""
    inputs = [np.asarray(jax.random.normal(jax.random.key(i), (rows, M)), np.float32)
              for i, (_, _, _, _, rows, _) in enumerate(CASES)]
    shapes = [dense(np, X).shape for X, (*_, dense) in zip(inputs, CASES, strict=True)]
    cots = [jax.random.normal(jax.random.key(100 + i), s) for i, s in enumerate(shapes)]
    sharded = jax.shard_map(
        lambda *xs: tuple(c[1](x) for c, x in zip(CASES, xs, strict=True)), mesh=mesh,
        in_specs=tuple(c[2] for c in CASES), out_specs=tuple(c[3] for c in CASES),
    )

    def dense(*xs):
        return tuple(c[5](jnp, x) for c, x in zip(CASES, xs, strict=True))

    def grads(f):  # gradient of sum_i <W_i, f_i(X_i)>: a cotangent that is not all ones
        return jax.grad(lambda xs: sum(jnp.sum(w * y) for w, y in zip(cots, f(*xs), strict=True)))

    xs = [jnp.asarray(x) for x in inputs]
    values = jax.jit(sharded).lower(*xs).compile(OPTIONS)(*xs)
    g_sharded = jax.jit(grads(sharded)).lower(xs).compile(OPTIONS)(xs)
    g_dense = jax.jit(grads(dense)).lower(xs).compile(OPTIONS)(xs)
    return inputs, values, g_sharded, g_dense


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_collective_value_and_gradient(results, index):
    inputs, values, g_sharded, g_dense = results
    want = CASES[index][5](np, inputs[index])  # the NumPy definition
    got = np.asarray(values[index])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_sharded[index]), np.asarray(g_dense[index]), rtol=1e-6, atol=1e-6)
    assert np.any(np.asarray(g_dense[index]) != 0)


def test_all_reduce_max_min_and_pytrees(mesh):
    X = np.asarray(jax.random.normal(jax.random.key(2), (N * K, M)), np.float32)

    def local(x):
        return {"max": C.all_reduce(x, "x", op="max"), "min": C.all_reduce(x, "x", op="min"),
                "sum": C.all_reduce({"a": x, "b": 2 * x}, "x")}

    out = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P())(jnp.asarray(X))
    b = X.reshape(N, K, M)
    np.testing.assert_allclose(out["max"], b.max(0))
    np.testing.assert_allclose(out["min"], b.min(0))
    np.testing.assert_allclose(out["sum"]["b"], 2 * b.sum(0), rtol=1e-6)


def test_tuple_axes_on_a_2d_mesh():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    X = np.asarray(jax.random.normal(jax.random.key(3), (8 * K, M)), np.float32)

    def local(x):
        return C.all_reduce(x, ("a", "b")), C.broadcast(x, ("a", "b"), root=6), C.axis_size(("a", "b"))

    total, bcast, size = jax.shard_map(
        local, mesh=mesh, in_specs=P(("a", "b")), out_specs=(P(), P(), P())
    )(jnp.asarray(X))
    assert int(size) == 8
    np.testing.assert_allclose(total, X.reshape(8, K, M).sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bcast, X.reshape(8, K, M)[6])


def test_to_varying_is_identity_forward_and_psum_backward(mesh):
    """Megatron's f: an invariant input made varying; its gradient sums the devices' cotangents."""
    x = jnp.arange(M, dtype=jnp.float32)
    w = jax.random.normal(jax.random.key(4), (N, M))

    def local(x, w):  # x invariant (replicated), w varying: one row per device
        return C.all_reduce(C.to_varying(x, "x") * w[0], "x")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    np.testing.assert_allclose(f(x, w), x * w.sum(0), rtol=1e-6)
    gx = jax.grad(lambda x: f(x, w).sum())(x)
    np.testing.assert_allclose(gx, w.sum(0), rtol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: C.broadcast(x, "x", root=8),
        lambda x: C.gather(x, "x", root=-1),
        lambda x: C.reduce_scatter(x, "x"),  # 2 rows do not split over 8 devices
        lambda x: C.all_to_all(x, "x", split_dim=0, concat_dim=1),
        lambda x: C.ppermute(x, "x", [(0, 1), (2, 1)]),
        lambda x: C.all_reduce(x, "x", op="prod"),
    ],
)
def test_bad_arguments_raise_value_error(mesh, bad):
    f = jax.shard_map(bad, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError), unchecked():  # as outside the suite: op="prod" is mistyped
        jax.eval_shape(f, jnp.zeros((N * K, M)))
