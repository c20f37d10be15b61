"""The manual (shard_map) path trains exactly like one device and like the automatic path,
and its compiled programs hold the collectives Megatron's analysis predicts.

Training cases reuse `parallel_cases` (the automatic path's tests): the same tiny
GPT-2-style and Llama-style models (8 heads; Llama: 4 kv heads, so tensor=8
replicates the kv projections and tensor=4 splits them), the same 5 batches and
AdamW steps through the library's `make_train_step`. Per-step losses and the
final weights are compared with the single-device run (and, for the GPT-2-style
model, the automatic run); gradients directly for a single block and a user's MLP.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.parallel import Manual, Strategy
from eqgpt.parallel import tensor as tp
from eqgpt.parallel.manual import manual_grad_fn, manual_loss_fn, manual_placement
from eqgpt.parallel.shard_map import filter_shard_map, place
from eqgpt.precision import Policy
from eqgpt.profile import collectives
from helpers import assert_arrays_close
from markov import falls
from parallel_cases import (
    CONFIGS,
    OPTIMIZER,
    OPTIONS,
    arrays,
    batches,
    reference_model,
    reference_run,
    sharded_run,
    train,
)

# (model, mesh, sequence parallel, the automatic strategy computing the same thing). Llama on
# tensor=8 replicates its 4 kv heads; on tensor=4 it splits them.
CASES = [("llama", "tensor=8", False, "tp"), ("gpt", "data=2,tensor=4", True, "dp+sp"),
         ("gpt", "data=2,tensor=4", False, "dp+tp"), ("llama", "data=2,tensor=4", True, "dp+sp")]
CASE_IDS = ["llama-tp8", "gpt-tp4-sp", "gpt-dp2-tp4", "llama-tp4-sp"]
@functools.cache
def manual(name, mesh_spec, sp):
    """5 AdamW steps of the library's step on the manual path: losses, final arrays, compiled step."""
    strategy = Strategy(par.make_mesh(mesh_spec), ("dp+" if "data" in mesh_spec else "") + ("sp" if sp else "tp"),
                        parts=(Manual(),))
    model = strategy.place_model(reference_model(name))
    opt_state = strategy.place_opt_state(OPTIMIZER.init(eqx.filter(model, eqx.is_array)), model)
    losses, state, compiled = train(strategy, model, opt_state)
    return losses, arrays(state.model), compiled, strategy.mesh


@pytest.mark.parametrize("name, mesh_spec, sp, strategy", CASES, ids=CASE_IDS)
def test_manual_trains_like_one_device_and_like_automatic(name, mesh_spec, sp, strategy):
    """Per-step losses and the weights after 5 AdamW steps equal one device's (and the automatic path's)."""
    ref_losses, ref_final, _ = reference_run(name)
    losses, final, *_ = manual(name, mesh_spec, sp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
    assert falls(ref_losses)
    assert_arrays_close(final, ref_final, "weights after 5 steps")
    if name == "gpt":  # the automatic runs the byte comparison compiles anyway
        auto_losses, auto_final, *_ = sharded_run(name, mesh_spec, strategy)
        np.testing.assert_allclose(losses, auto_losses, rtol=1e-5, atol=0)
        assert_arrays_close(final, auto_final, "manual vs automatic weights")


def _wire(rows, kind, *, axes=("tensor",), dtype="f32", phase=None):
    """Bytes each device sends for `kind` on `axes` (ring: all-reduce 2(n-1)/n, others (n-1)/n)."""
    total = 0.0
    for r in rows:
        if r.effective_kind != kind or r.axes != axes or (phase and r.phase != phase):
            continue
        if not all(s.startswith(dtype) for s in r.shapes):
            continue
        n = r.group_size
        total += r.total_bytes * (2 if kind == "all-reduce" else 1) * (n - 1) / n
    return total


@functools.cache
def forward_program(name, mesh_spec, sp):
    mesh = par.make_mesh(mesh_spec)
    model = reference_model(name)
    loss_fn = manual_loss_fn(model, mesh, sequence_parallel=sp)
    batch = Strategy(mesh, "dp+tp", parts=(Manual(),)).batch(batches(1)[0])
    placed = place(model, mesh, tp.tensor_parallel_specs(model, mesh))
    compiled = eqx.filter_jit(loss_fn).lower(placed, batch).compile(OPTIONS)
    return collectives(compiled, mesh), mesh


ACT = "f32[4,32,32]"  # one device's [batch/2, seq, embed] activations on data=2,tensor=4


def test_tp_forward_has_two_all_reduces_per_layer():
    rows, _ = forward_program("gpt", "data=2,tensor=4", False)
    layers = CONFIGS["gpt"].num_layers
    tensor_ar = [r for r in rows if r.kind == "all-reduce" and r.axes == ("tensor",)]
    in_layers = [r for r in tensor_ar if r.executions == layers]
    assert len(in_layers) == 2 and all(r.shapes == (ACT,) for r in in_layers)  # g after attention, g after MLP
    outside = [r for r in tensor_ar if r.executions == 1]
    # The vocab-parallel embedding's g, and the loss's [batch, seq] statistics
    # (the max; the sum of exponentials and the target logit, combined by XLA).
    assert sorted(r.shapes for r in outside) == sorted([(ACT,), ("f32[4,32]",), ("f32[4,32]", "f32[4,32]")])
    assert not [r for r in rows if r.kind in ("all-gather", "reduce-scatter")]


def test_sp_swaps_each_all_reduce_for_all_gather_and_reduce_scatter_of_equal_bytes():
    tp_rows, _ = forward_program("gpt", "data=2,tensor=4", False)
    sp_rows, _ = forward_program("gpt", "data=2,tensor=4", True)
    assert not [r for r in sp_rows if r.kind == "all-reduce" and ACT in r.shapes]
    layers = CONFIGS["gpt"].num_layers
    for kind in ("all-gather", "reduce-scatter"):
        assert len([r for r in sp_rows if r.kind == kind and r.executions == layers]) == 2
    tp_wire = _wire(tp_rows, "all-reduce")
    sp_wire = _wire(sp_rows, "all-gather") + _wire(sp_rows, "reduce-scatter")
    loss_stats = _wire([r for r in tp_rows if ACT not in r.shapes], "all-reduce")
    assert sp_wire == pytest.approx(tp_wire - loss_stats, rel=1e-9)
    assert _wire(sp_rows, "all-reduce") == pytest.approx(loss_stats, rel=1e-9)  # the loss keeps its own


def _total_wire(rows):
    return sum(_wire([r], r.effective_kind, axes=r.axes, dtype="") for r in rows)


def test_one_all_reduce_per_region_and_fewer_bytes_than_automatic():
    """A training step's collectives (docs/parallelism/manual.md, "Manual vs automatic").

    Manual TP: per layer exactly 2 activation all-reduces forward (`g`) and 2 backward
    (`f`): attention enters its region once, so the input gradients of q, k and v are
    summed locally before one all-reduce. The automatic program reduces those three
    separately (one combined all-reduce of three `[b T, D]` operands per layer); with
    those two extra activations removed, the two programs move the same bytes (5%).
    Under SP the manual step moves fewer bytes too.
    """
    mesh = par.make_mesh("data=2,tensor=4")
    layers = CONFIGS["gpt"].num_layers
    manual_rows = collectives(manual("gpt", "data=2,tensor=4", False)[2], mesh)
    per_layer = [r for r in manual_rows if r.kind == "all-reduce" and r.axes == ("tensor",) and r.executions == layers]
    assert sorted((r.phase, r.shapes) for r in per_layer) == [("backward", (ACT,))] * 2 + [("forward", (ACT,))] * 2

    auto_rows = collectives(sharded_run("gpt", "data=2,tensor=4", "dp+tp")[2], mesh)
    qkv = [r for r in auto_rows if r.axes == ("tensor",) and len(r.shapes) == 3 and r.executions == layers]
    assert len(qkv) == 1 and len(set(qkv[0].shapes)) == 1
    manual_bytes, auto_bytes = _total_wire(manual_rows), _total_wire(auto_rows)
    assert manual_bytes < auto_bytes
    assert auto_bytes - _total_wire(qkv) * 2 / 3 == pytest.approx(manual_bytes, rel=0.05)

    sp_manual = _total_wire(collectives(manual("gpt", "data=2,tensor=4", True)[2], mesh))
    assert sp_manual < _total_wire(collectives(sharded_run("gpt", "data=2,tensor=4", "dp+sp")[2], mesh))


def test_gradients_are_reduced_in_fp32_under_bf16_compute():
    mesh = par.make_mesh("data=8")
    model = reference_model("gpt")
    grad_fn = manual_grad_fn(model, mesh, policy=Policy.named("bf16"))
    host = batches(1)[0]
    x, y = host.tokens, host.targets
    batch = Strategy(mesh, "dp", parts=(Manual(),)).batch(host)
    compiled = eqx.filter_jit(grad_fn).lower(place(model, mesh, tp.tensor_parallel_specs(model, mesh)),
                                             batch).compile(OPTIONS)
    data_rows = [r for r in collectives(compiled, mesh) if r.axes == ("data",)]
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert all(s.startswith("f32") for r in data_rows for s in r.shapes)
    assert sum(r.total_bytes for r in data_rows) >= grad_bytes  # every gradient, plus the loss scalars
    (loss, _), grads = compiled(place(model, mesh, tp.tensor_parallel_specs(model, mesh)), batch)
    ref = nn.lm_loss(model, jnp.asarray(x), jnp.asarray(y))[0]
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert abs(float(loss) - float(ref)) < 0.05  # bf16 forward


def test_masked_z_loss_with_segments_matches_one_device():
    """Loss masks are normalised by the global token count; z-loss and documents work under dp x sp."""
    model = reference_model("llama")
    x, y = batches(1)[0].tokens, batches(1)[0].targets
    mask = (np.arange(x.shape[1])[None] < np.array([32, 20, 7, 32, 0, 32, 11, 25])[:, None]).astype(np.float32)
    seg = (np.arange(x.shape[1])[None] >= 13).astype(np.int32).repeat(x.shape[0], 0)
    ref, ref_aux = nn.lm_loss(model, jnp.asarray(x), jnp.asarray(y), loss_mask=jnp.asarray(mask),
                              segment_ids=jnp.asarray(seg), z_loss=1e-2, chunk_size=8)
    mesh = par.make_mesh("data=2,tensor=4")
    loss_fn = manual_loss_fn(model, mesh, sequence_parallel=True, z_loss=1e-2, chunk_size=8)
    batch = Strategy(mesh, "dp+sp", parts=(Manual(),)).batch(Batch(x, y, loss_mask=mask, segment_ids=seg))
    placed = place(model, mesh, tp.tensor_parallel_specs(model, mesh))
    loss, aux = eqx.filter_jit(loss_fn).lower(placed, batch).compile(OPTIONS)(placed, batch)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    np.testing.assert_allclose(float(aux["z_loss"]), float(ref_aux["z_loss"]), rtol=1e-6)


def test_vocab_parallel_cross_entropy_equals_dense():
    mesh = jax.make_mesh((8,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    logits = 3 * jax.random.normal(jax.random.key(0), (5, 64))
    targets = jax.random.randint(jax.random.key(1), (5,), 0, 64)

    def local(lg, t):
        start = jax.lax.axis_index("tensor") * lg.shape[-1]
        return tp.vocab_parallel_cross_entropy(lg, t, start, "tensor")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "tensor"), P()), out_specs=(P(), P()))

    def dense(lg, t):
        lse = jax.nn.logsumexp(lg, axis=-1)
        return lse - jnp.take_along_axis(lg, t[:, None], axis=-1)[:, 0], lse

    w = jnp.arange(5.0)

    @jax.jit
    def both(logits):
        grad = lambda f: jax.grad(lambda lg: jnp.sum(w * f(lg, targets)[0]))(logits)  # noqa: E731
        return sharded(logits, targets), dense(logits, targets), grad(sharded), grad(dense)

    got, want, g_got, g_want = both.lower(logits).compile(OPTIONS)(logits)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(g_got, g_want, rtol=1e-5, atol=1e-7)


def test_a_single_block_can_be_wrapped():
    """`tensor_parallel(block)` under `filter_shard_map`, with and without SP, equals the block."""
    config = CONFIGS["llama"]
    block = nn.make_block(config, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (2, 16, config.embed_dim))
    mesh = par.make_mesh("tensor=8")
    specs = tp.tensor_parallel_specs(block, mesh)

    def run(sp):
        def local(block, x):
            swapped = tp.tensor_parallel(block, size=8, sequence_parallel=sp, seq_len=16)
            return swapped(x, positions=positions(x, sp))

        seq = P(None, "tensor") if sp else P()
        return filter_shard_map(local, mesh=mesh, in_specs=(specs, seq), out_specs=seq)

    def positions(x, sp):  # attention sees the whole sequence (it gathers it on entry under SP)
        return jnp.arange(x.shape[1] * (8 if sp else 1))

    @jax.jit
    def outputs(block, x):
        w = jnp.cos(jnp.arange(x.size).reshape(x.shape))
        loss = lambda f: lambda b: jnp.sum(w * f(b, x))  # noqa: E731
        return [jax.value_and_grad(loss(f))(block) for f in (lambda b, x: b(x), run(False), run(True))]

    (want, g_want), *rest = outputs.lower(block, x).compile(OPTIONS)(block, x)
    for got, g in rest:
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "config, size, part, needle",
    [
        (CONFIGS["gpt"].replace(num_heads=4, embed_dim=32), 8, "blocks", "attention heads"),
        (CONFIGS["gpt"].replace(mlp_dim=36), 8, "blocks", "MLP width"),
        (CONFIGS["gpt"].replace(vocab_size=60), 8, "tok_embed", "vocabulary"),
        (CONFIGS["llama"].replace(vocab_size=62), 4, "head", "vocabulary"),
        (CONFIGS["llama"].replace(num_heads=6, num_kv_heads=3, embed_dim=48), 2, "blocks", "kv heads"),
        (CONFIGS["llama"].replace(num_heads=12, num_kv_heads=3, embed_dim=48), 4, "blocks", "kv heads"),
    ],
)
def test_sizes_that_do_not_split_raise_when_wrapped(config, size, part, needle):
    model = eqx.filter_eval_shape(nn.GPT, config, key=jax.random.key(0))
    for module in (model, getattr(model, part)):  # the whole GPT, and the part alone
        with pytest.raises(ValueError, match=needle):
            tp.tensor_parallel(module, size=size)


def test_bad_batches_and_meshes_raise_before_compiling():
    model = eqx.filter_eval_shape(nn.GPT, CONFIGS["gpt"], key=jax.random.key(0))
    mesh = par.make_mesh("data=2,tensor=4")
    grad_fn = manual_grad_fn(model, mesh, sequence_parallel=True)
    tokens = jnp.zeros((8, 31), jnp.int32)
    with pytest.raises(ValueError, match="sequence"):
        grad_fn(model, Batch(tokens[:, :30], tokens[:, :30]))  # 30 % 4
    with pytest.raises(ValueError, match="rows"):
        grad_fn(model, Batch.from_windows(tokens[:3]))
    with pytest.raises(ValueError, match="Batch"):
        grad_fn(model, tokens)
    with pytest.raises(ValueError, match="fsdp"):
        manual_grad_fn(model, par.make_mesh("fsdp=2,tensor=4"))
    with pytest.raises(ValueError, match="sequence_parallel"):
        manual_grad_fn(model, par.make_mesh("data=8"), sequence_parallel=True)


def test_placement_replicates_whole_kv_heads():
    """`manual_placement` (here 4 kv heads on tensor=8) lays the model out as `tensor_parallel_specs` says."""
    mesh = par.make_mesh("tensor=8")
    model = reference_model("llama")
    placement = manual_placement(mesh, model)
    specs = par.param_specs(model, placement.rules, placement.overrides, mesh=mesh)
    assert jax.tree.leaves(specs) == jax.tree.leaves(tp.tensor_parallel_specs(model, mesh))
    assert placement.place_model(model).blocks.attn.k_proj.weight.sharding.spec == P(None, None, None)


class SquaredReLU(eqx.Module):
    """A user's MLP: `down(relu(up(x))^2)`, built from `Linear`s with logical axes."""

    up: nn.Linear
    down: nn.Linear
    shard: nn.NoConstraint
    enter: bool = eqx.field(static=True)

    def __init__(self, dim, hidden, *, enter, key):
        k1, k2 = jax.random.split(key)
        self.up = nn.Linear(dim, hidden, axes=("embed", "mlp"), key=k1)
        self.down = nn.Linear(hidden, dim, axes=("mlp", "embed"), key=k2)
        self.shard, self.enter = nn.NoConstraint(), enter

    def __call__(self, x):
        if self.enter:
            x = self.shard(x, ("batch", "inner_seq", "embed"))
        return self.down(jnp.square(jax.nn.relu(self.up(x))))


def user_model(enter: bool):
    config = CONFIGS["gpt"]

    def block(c, *, key):
        b = nn.make_block(c, key=key)
        return eqx.tree_at(lambda b: b.mlp, b, SquaredReLU(c.embed_dim, c.hidden_dim, enter=enter, key=key))

    return eqx.filter_jit(lambda k: nn.GPT(config, key=k, block_factory=block))(jax.random.key(0))


@pytest.mark.parametrize("rules, enter", [("dp+tp", False), ("dp+sp", True)])
def test_a_users_mlp_trains_like_one_device(rules, enter):
    """Row/column forms come from the Linears' axis names; no code of the module is copied."""
    model = user_model(enter)
    step = lambda s: eqx.filter_jit(s.grad_fn(model_like=model))  # noqa: E731
    batch = batches(1)[0]
    (want, _), g_want = step(Strategy())(model, batch)
    strategy = Strategy(par.make_mesh("data=2,tensor=4"), rules, parts=(Manual(),))
    (got, _), g_got = step(strategy)(strategy.place_model(model), strategy.batch(batch))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    assert_arrays_close(arrays(g_got), arrays(g_want), "gradients")


def test_a_users_mlp_that_never_enters_its_region_fails_clearly_under_sp():
    model = user_model(enter=False)
    strategy = Strategy(par.make_mesh("data=2,tensor=4"), "dp+sp", parts=(Manual(),))
    with pytest.raises(ValueError, match=r"blocks\.mlp\.up.*never entered its tensor-parallel region"):
        jax.eval_shape(strategy.grad_fn(model_like=model), model, strategy.batch(batches(1)[0]))
