"""Collective matmul and gradient buckets: the same numbers, and the compiled programs show the change.

- The two rings (`all_gather_matmul`, `matmul_reduce_scatter`) equal the dense
  product on 8 devices, values and gradients.
- Collective matmul replaces every all-gather and reduce-scatter of a block (forward
  and backward) by `n-1` collective-permutes of one chunk, whose bytes sum to the
  replaced collective's `(n-1)/n` volume.
- Buckets cut the gradient all-reduces to `buckets.all_reduce_count` while the
  bytes stay equal, on the manual path and in the pipeline's end-of-step reductions.

Training parity through `recipes/train_gpt.py` is in `test_strategies.py`.
"""

import functools
import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from eqgpt import parallel as par
from eqgpt.parallel import buckets
from eqgpt.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from eqgpt.parallel.manual import bucket_report, manual_grad_fn
from eqgpt.parallel.pipeline import pipeline_grad_fn
from eqgpt.parallel.shard_map import place
from eqgpt.parallel.tensor import tensor_parallel_specs
from eqgpt.profile import collectives
from parallel_cases import CONFIGS, OPTIONS, batches, reference_model

N = 8


def test_rings_equal_the_dense_products_and_their_gradients():
    mesh = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (2, 16, 8))  # [b, T, D], T split over x on the column side
    w = jax.random.normal(keys[1], (8, 4 * N))  # column side: device i holds columns i
    h = jax.random.normal(keys[2], (2, 16, 2 * N))  # row side: features split over x
    v = jax.random.normal(keys[3], (2 * N, 8))  # row side: device i holds rows i
    cot_col, cot_row = jax.random.normal(keys[4], (2, 16, 4 * N)), jax.random.normal(keys[5], (2, 16, 8))

    ring = jax.shard_map(
        lambda x, w, h, v: (all_gather_matmul(x, w, "x", dim=1), matmul_reduce_scatter(h, v, "x", dim=1)),
        mesh=mesh, in_specs=(P(None, "x"), P(None, "x"), P(None, None, "x"), P("x")),
        out_specs=(P(None, None, "x"), P(None, "x")))

    def dense(x, w, h, v):
        return x @ w, h @ v

    def loss(f):
        return lambda *a: sum(jnp.sum(c * y) for c, y in zip((cot_col, cot_row), f(*a), strict=True))

    args = (x, w, h, v)
    for got, want in zip(jax.jit(ring)(*args), dense(*args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g_ring = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2, 3)))(*args)
    g_dense = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*args)
    for got, want in zip(g_ring, g_dense, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@functools.cache
def manual_program(mesh_spec: str, sp: bool, collective_matmul: bool = False, bucket_mb: float | None = None):
    """The manual path's compiled gradient step: (inventory, lowered StableHLO text, mesh, model)."""
    mesh = par.make_mesh(mesh_spec)
    model = reference_model("gpt")
    grad_fn = manual_grad_fn(model, mesh, sequence_parallel=sp, collective_matmul=collective_matmul,
                             bucket_bytes=buckets.bucket_bytes_of(bucket_mb))
    batch = par.Strategy(mesh, "dp+tp" if "tensor" in mesh_spec else "dp", parts=(par.Manual(),)).batch(batches(1)[0])
    placed = place(model, mesh, tensor_parallel_specs(model, mesh))
    lowered = eqx.filter_jit(grad_fn).lower(placed, batch)
    return collectives(lowered.compile(OPTIONS), mesh), lowered.as_text(), mesh, model


def _in_layers(rows, kind):
    layers = CONFIGS["gpt"].num_layers
    return [r for r in rows if r.effective_kind == kind and r.axes == ("tensor",) and r.executions == layers]


def test_collective_matmul_replaces_each_gather_and_scatter_of_a_block_by_n_minus_1_permutes():
    plain, *_ = manual_program("data=2,tensor=4", True)
    ring, _, mesh, _ = manual_program("data=2,tensor=4", True, collective_matmul=True, bucket_mb=0.01)
    n = mesh.shape["tensor"]
    replaced = _in_layers(plain, "all-gather") + _in_layers(plain, "reduce-scatter")
    # Per layer: attention's and the MLP's region entry (all-gather) and exit (reduce-scatter),
    # forward, and their transposes backward.
    assert len(replaced) == 8 and not _in_layers(plain, "collective-permute")
    assert not _in_layers(ring, "all-gather") and not _in_layers(ring, "reduce-scatter")
    permutes = _in_layers(ring, "collective-permute")
    assert len(permutes) == len(replaced) * (n - 1)
    assert {s for r in permutes for s in r.shapes} == {"f32[4,8,32]"}  # one [b, T/n, D] chunk each
    wire = sum(r.total_bytes * (n - 1) / n for r in replaced)  # all-gather / reduce-scatter: (n-1)/n
    assert sum(r.total_bytes for r in permutes) == pytest.approx(wire, rel=1e-12)
    outside = lambda rows: sorted((r.effective_kind, r.shapes) for r in rows  # noqa: E731
                                  if r.executions == 1 and r.axes == ("tensor",))
    assert outside(ring) == outside(plain)  # the head's gather and the embedding's scatter are unchanged


def _grad_all_reduces(rows, axes):
    """The gradient all-reduces over `axes`: every operand but the loss's scalars."""
    return [s for r in rows if r.kind == "all-reduce" and r.axes == axes for s in r.shapes if s != "f32[]"]


def _size(shape: str) -> int:
    dims = re.search(r"\[([0-9,]*)\]", shape).group(1)
    return 4 * math.prod(int(d) for d in dims.split(",") if d)


# The buckets of the GPT-2 test model's 20 gradient arrays at 0.01 MiB (10485 bytes), worked out
# by hand from their fp32 bytes in tree order: the table (8192) and the position table (4096)
# overflow together; 4096 + two 256-byte norm arrays fit; each 8192-byte projection takes its
# 256-byte bias; the output projection also takes the MLP norm's two; the 32768-byte MLP matrices
# are alone and so is the up bias (1024 + 32768 overflows); the last three (256 + 128 + 128) share.
HAND_BUCKETS = [
    ["tok_embed.weight"],
    ["pos_embed.weight", "blocks.attn_norm.weight", "blocks.attn_norm.bias"],
    ["blocks.attn.q_proj.weight", "blocks.attn.q_proj.bias"],
    ["blocks.attn.k_proj.weight", "blocks.attn.k_proj.bias"],
    ["blocks.attn.v_proj.weight", "blocks.attn.v_proj.bias"],
    ["blocks.attn.o_proj.weight", "blocks.attn.o_proj.bias", "blocks.mlp_norm.weight", "blocks.mlp_norm.bias"],
    ["blocks.mlp.up.weight"],
    ["blocks.mlp.up.bias"],
    ["blocks.mlp.down.weight"],
    ["blocks.mlp.down.bias", "norm.weight", "norm.bias"],
]


def test_buckets_cut_the_data_parallel_all_reduces_to_the_documented_count_with_equal_bytes():
    plain, plain_text, _, model = manual_program("data=8", False)
    bucketed, bucketed_text, *_ = manual_program("data=8", False, bucket_mb=0.01)
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
    names, params = [par.path_str(p) for p, _ in flat], [x for _, x in flat]
    sizes = [("data", 4 * p.size) for p in params]
    plan = buckets.bucket_plan([s for _, s in sizes], buckets.bucket_bytes_of(0.01))
    assert [[names[i] for i in b] for b in plan] == HAND_BUCKETS
    before = buckets.all_reduce_count(sizes, None)
    after = buckets.all_reduce_count(sizes, buckets.bucket_bytes_of(0.01))
    assert (before, after) == (len(names), len(HAND_BUCKETS)) == (20, 10)  # see docs/parallelism/dp.md
    strategy = par.Strategy(par.make_mesh("data=8"), "dp", parts=(par.Manual(bucket_mb=0.01),))
    assert bucket_report(strategy, model) == "gradient all-reduces per step: 20 -> 10 (buckets of at most 0.01 MiB)"
    # The program issues one all-reduce per bucket (XLA:CPU then combines independent ones into one
    # variadic instruction; its operands are the reductions).
    ops = lambda text: len(re.findall(r"stablehlo\.all_reduce", text))  # noqa: E731
    assert ops(plain_text) - ops(bucketed_text) == before - after
    got, want = _grad_all_reduces(bucketed, ("data",)), _grad_all_reduces(plain, ("data",))
    assert (len(want), len(got)) == (before, after)
    assert sum(map(_size, got)) == sum(map(_size, want)) == sum(s for _, s in sizes)


@functools.cache
def pipeline_grads(bucket_mb: float | None):
    mesh = par.make_mesh("pipeline=2,data=4")
    model = reference_model("gpt")
    fn = pipeline_grad_fn(mesh, "1f1b", 2, bucket_bytes=buckets.bucket_bytes_of(bucket_mb))
    batch = par.Strategy(mesh, "dp", parts=(par.Pipeline("1f1b", 2),)).batch(batches(1)[0])
    dynamic, static = eqx.partition(model, eqx.is_array)
    compiled = jax.jit(lambda d, b: fn(eqx.combine(d, static), b)).lower(dynamic, batch).compile(OPTIONS)
    return collectives(compiled, mesh), compiled(dynamic, batch)


def test_pipeline_end_of_step_reductions_in_buckets():
    (plain, ((loss, _), grads)), (bucketed, ((b_loss, _), b_grads)) = pipeline_grads(None), pipeline_grads(0.01)
    np.testing.assert_allclose(b_loss, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(b_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # The embedding and head's 4 arrays summed over stages, then all 20 over `data`
    # (docs/parallelism/dp.md): 0.01 MiB buckets cut them to 2 and 8, bytes equal.
    for axes, counts in ((("pipeline",), (4, 2)), (("data",), (20, 8))):
        got, want = _grad_all_reduces(bucketed, axes), _grad_all_reduces(plain, axes)
        assert (len(want), len(got)) == counts and sum(map(_size, got)) == sum(map(_size, want)), axes


def test_bucket_report_counts_what_the_compiled_sequence_parallel_step_reduces():
    """Under SP the gradients reduce over `data` (tensor-split weights) and over `data` and
    `tensor` (the replicated ones); each group has its buckets, as `bucket_report` counts."""
    plain, *_ = manual_program("data=2,tensor=4", True)
    bucketed, _, mesh, model = manual_program("data=2,tensor=4", True, collective_matmul=True, bucket_mb=0.01)
    groups = (("data",), ("data", "tensor"))
    before = sum(len(_grad_all_reduces(plain, g)) for g in groups)
    after = sum(len(_grad_all_reduces(bucketed, g)) for g in groups)
    strategy = par.Strategy(mesh, "dp+sp", parts=(par.Manual(collective_matmul=True, bucket_mb=0.01),))
    assert bucket_report(strategy, model) == (f"gradient all-reduces per step: {before} -> {after} "
                                              "(buckets of at most 0.01 MiB)")
    assert after < before
    assert [sum(map(_size, _grad_all_reduces(bucketed, g))) for g in groups] == \
        [sum(map(_size, _grad_all_reduces(plain, g))) for g in groups]
