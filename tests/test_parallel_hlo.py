"""The compiled programs of the automatic strategies, read from their HLO.

Figures are per device and per train step (loop trip counts multiplied in), from
`eqgpt.profile.collectives` and `eqgpt.profile.memory`. The compiled steps are the
ones `test_parallel_parity` trains with (shared through `parallel_cases`).

CPU-backend artefact, handled here rather than hidden: XLA's CPU backend has no
reduce-scatter, so where the SPMD partitioner wants one (FSDP gradients, SP's
reduce of the residual stream) it compiles an all-reduce of the whole array and a
dynamic-slice keeping this device's part. The inventory reports that pattern as
"all-reduce+slice"; GPU and TPU compile the same program to a real reduce-scatter,
and a `psum_scatter` written by hand in `shard_map` is a real reduce-scatter even on CPU.
"""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eqgpt import parallel as par
from eqgpt.profile import SLICED, collective_summary, collectives, memory, report
from parallel_cases import BATCH, CONFIGS, SEQ, param_bytes, reference_run, sharded_run

FLOAT = ("f32", "bf16", "f16")


def inventory(name, mesh, strategy):
    _, _, compiled, placement, model = sharded_run(name, mesh, strategy)
    return collectives(compiled, placement.mesh), placement, model, compiled


def floats(rows):
    """Collectives of float arrays (parameters, gradients, activations), not token ids."""
    return [r for r in rows if all(s.startswith(FLOAT) for s in r.shapes)]


def within(measured, expected, rel):
    assert abs(measured - expected) <= rel * expected, (measured, expected)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dp_gradient_all_reduces_total_the_parameter_bytes(name):
    rows, _, model, _ = inventory(name, "data=8", "dp")
    assert {r.kind for r in rows} == {"all-reduce"} and {r.axes for r in rows} == {("data",)}
    expected = param_bytes(model)
    if CONFIGS[name].tie_embeddings:
        # The tied table gets two gradient contributions (lookup and head) and
        # XLA reduces each before adding them: one extra table.
        expected += model.tok_embed.weight.size * 4
    within(sum(r.total_bytes for r in rows), expected, 0.01)


def sharded_and_replicated_bytes(model, placement):
    specs = jax.tree.leaves(par.param_specs(model, placement.rules, mesh=placement.mesh),
                            is_leaf=lambda s: isinstance(s, P))
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    sharded = sum(a.size * 4 for a, s in zip(arrays, specs, strict=True) if any(e is not None for e in s))
    return sharded, param_bytes(model) - sharded


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fsdp_gathers_parameters_and_reduce_scatters_gradients(name):
    rows, placement, model, _ = inventory(name, "fsdp=8", "fsdp")
    sharded, replicated = sharded_and_replicated_bytes(model, placement)
    assert replicated < 0.02 * param_bytes(model)  # only heads/mlp-sized biases stay whole
    rows = floats(rows)
    gather_fwd = sum(r.total_bytes for r in rows if r.kind == "all-gather" and r.phase == "forward")
    gather_bwd = sum(r.total_bytes for r in rows if r.kind == "all-gather" and r.phase == "backward")
    scatter = sum(r.total_bytes for r in rows if r.effective_kind == "reduce-scatter")
    # Scalars (loss terms, gradient norm, the finite guard) aside, every all-reduce is a weight's.
    reduce = sum(r.total_bytes for r in rows if r.kind == "all-reduce" and not all(s.endswith("[]") for s in r.shapes))
    # ZeRO-3: every sharded weight is gathered once in the forward pass, gathered
    # again in the backward pass where the backward needs it (biases and the position
    # table are not needed there), and its gradient reduce-scattered once. One
    # exception, XLA's choice: the token lookup runs on the table's shards (it
    # all-gathers the token ids and all-to-alls the embedded activations instead),
    # so an untied table is neither gathered nor reduce-scattered. A tied table is
    # gathered for the head, and its head gradient reduce-scattered; the fused head
    # (`eqgpt.nn.head_loss_sums`) makes that gradient in the forward pass, so the
    # backward pass never gathers the table again.
    table = model.tok_embed.weight.size * 4
    if not CONFIGS[name].tie_embeddings:
        sharded -= table
        assert any(r.kind == "all-to-all" for r in rows)
    needed_bwd = sharded - table if CONFIGS[name].tie_embeddings else sharded
    within(gather_fwd, sharded, 0.01)
    within(scatter, sharded, 0.01)
    assert 0.9 * needed_bwd <= gather_bwd <= needed_bwd
    assert 1.9 <= (gather_fwd + gather_bwd + sharded - needed_bwd) / scatter <= 2.0
    # Replicated weights are all-reduced like DP.
    assert reduce == replicated
    # CPU artefact: no real reduce-scatter, the all-reduce+slice pattern instead.
    assert {r.kind for r in rows if r.effective_kind == "reduce-scatter"} == {SLICED}


def test_fsdp_holds_an_eighth_of_parameters_and_optimizer_state_per_device():
    _, _, ref_compiled = reference_run("gpt")
    _, _, compiled, placement, model = sharded_run("gpt", "fsdp=8", "fsdp")
    batch_bytes = 2 * BATCH * SEQ * 4  # inputs and targets, int32
    single = memory(ref_compiled).argument_bytes - batch_bytes
    per_device = memory(compiled).argument_bytes - batch_bytes // 8
    assert single > 3 * param_bytes(model)  # params + Adam's two moments
    assert per_device <= (1 / 8 + 0.02) * single, (per_device, single)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp_forward_has_two_activation_all_reduces_per_layer(name):
    rows, _, _, _ = inventory(name, "tensor=8", "tp")
    layers = CONFIGS[name].num_layers
    act = BATCH * SEQ * CONFIGS[name].embed_dim * 4  # one [B, T, D] fp32 activation
    in_layers = [r for r in rows if r.phase == "forward" and r.executions == layers]
    assert [(r.kind, r.bytes, r.axes) for r in in_layers] == [("all-reduce", act, ("tensor",))] * 2
    # After the attention output projection and after the MLP down projection:
    # 2 per layer, 2 L per forward pass.
    assert sum(r.total_bytes for r in in_layers) == 2 * layers * act


def test_sp_turns_those_all_reduces_into_all_gathers_and_reduce_scatters():
    tp_rows, *_ = inventory("gpt", "tensor=8", "tp")
    sp_rows, *_ = inventory("gpt", "tensor=8", "sp")
    layers = CONFIGS["gpt"].num_layers
    act = BATCH * SEQ * CONFIGS["gpt"].embed_dim * 4

    def forward_in_layers(rows):
        return [r for r in rows if r.phase == "forward" and r.executions == layers]

    tp_bytes = sum(r.total_bytes for r in forward_in_layers(tp_rows) if r.kind == "all-reduce")
    sp = forward_in_layers(sp_rows)
    assert not [r for r in sp if r.kind == "all-reduce"]
    gathers = [r for r in sp if r.kind == "all-gather"]
    scatters = [r for r in sp if r.effective_kind == "reduce-scatter"]
    assert [r.bytes for r in gathers] == [act, act] and [r.bytes for r in scatters] == [act, act]
    assert sum(r.total_bytes for r in gathers) == sum(r.total_bytes for r in scatters) == tp_bytes
    # On CPU each reduce-scatter is the all-reduce+slice pattern (GPU/TPU: reduce-scatter).
    assert {r.kind for r in scatters} == {SLICED}
    assert_parity = sharded_run("gpt", "tensor=8", "sp")[0]
    np.testing.assert_allclose(assert_parity, reference_run("gpt")[0], rtol=1e-5)


def test_hand_written_psum_scatter_is_a_real_reduce_scatter_even_on_cpu():
    mesh = par.make_mesh("fsdp=8")
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("fsdp")))

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    def manual(x):
        return jax.lax.psum_scatter(x[0], "fsdp", tiled=True)[None]

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("fsdp"), out_specs=P())
    def manual_sum(x):
        return jax.lax.psum(x[0], "fsdp")

    # The same reduction left to the partitioner: sum over the sharded axis, result sharded.
    automatic = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, P("fsdp")))

    def kinds(f):
        return [(r.kind, r.bytes, r.group_size) for r in collectives(f.lower(x).compile(), mesh)]

    assert kinds(manual) == [("reduce-scatter", 256, 8)]
    assert kinds(manual_sum) == [("all-reduce", 256, 8)]
    assert kinds(automatic) == [(SLICED, 256, 8)]
    np.testing.assert_allclose(np.asarray(manual(x)).ravel(), np.asarray(automatic(x)))


SYNTHETIC_GPU_HLO = """\
HloModule step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %ars = f32[1024]{0} all-reduce-start(f32[1024]{0} %x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, \
use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024]{0}) tuple(%j, %ard)
}

%cond (q: (s32[], f32[1024])) -> pred[] {
  %q = (s32[], f32[1024]{0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (x: f32[128], y: bf16[256]) -> f32[1024] {
  %x = f32[128]{0} parameter(0)
  %y = bf16[256]{0} parameter(1)
  %ags = (f32[128]{0}, f32[1024]{0}) all-gather-start(%x), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, \
use_global_device_ids=true
  %agd = f32[1024]{0} all-gather-done(%ags)
  %rs = bf16[128]{0} reduce-scatter(%y), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %cps = (bf16[128]{0}, bf16[128]{0}, u32[], u32[]) collective-permute-start(%rs), channel_id=4, \
source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cpd = bf16[128]{0} collective-permute-done(%cps)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %agd)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def test_inventory_reads_async_forms_groups_and_loop_trip_counts():
    """GPU-style HLO (async -start/-done pairs, iota and explicit groups), written by hand."""
    mesh = par.make_mesh("data=2,tensor=4")
    rows = {r.kind: r for r in collectives(SYNTHETIC_GPU_HLO, mesh)}
    assert set(rows) == {"all-gather", "reduce-scatter", "collective-permute", "all-reduce"}
    ag, rs, cp, ar = rows["all-gather"], rows["reduce-scatter"], rows["collective-permute"], rows["all-reduce"]
    assert (ag.bytes, ag.group_size, ag.axes, ag.is_async) == (4096, 8, ("data", "tensor"), True)
    assert (rs.bytes, rs.group_size, rs.axes) == (512, 2, ("data",))  # operand = 2 x bf16[128]
    assert (cp.bytes, cp.axes) == (256, ("tensor",))
    assert (ar.bytes, ar.executions, ar.total_bytes, ar.axes, ar.phase) == (4096, 3, 12288, ("tensor",), "backward")
    summary = collective_summary(SYNTHETIC_GPU_HLO, mesh=mesh, as_reduce_scatter=True)
    assert [(s.kind, s.executions) for s in summary] == [
        ("all-reduce", 3), ("all-gather", 1), ("reduce-scatter", 1), ("collective-permute", 1)]


def _one_collective(groups):
    return (
        "HloModule m\n\nENTRY %main (x: f32[32]) -> (f32[32], f32[32]) {\n"
        "  %x = f32[32]{0} parameter(0)\n"
        f"  ROOT %a = (f32[32]{{0}}, f32[32]{{0}}) all-to-all(%x, %x), channel_id=1, replica_groups={groups}\n"
        "}\n"
    )


@pytest.mark.parametrize("printed, expected, axes", [
    # jax 0.10: synthetic axes over a permuted device list; jax 0.12: the named mesh, sub-axes.
    ("mesh['axis_0'=2,'axis_1'=2,'axis_2'=1,'axis_3'=1,'axis_4'=1,'axis_5'=2], "
     "device_ids=([2,2,2]T(2,1,0)) {'axis_1'}", "{{0,2},{1,3},{4,6},{5,7}}", ("pipeline",)),
    ("mesh['data'=2,'fsdp'=1,'pipeline'=4,'context'=1,'tensor'=1] {'pipeline':(1)2}",
     "{{0,2},{1,3},{4,6},{5,7}}", ("pipeline",)),
    ("mesh['data'=2,'fsdp'=1,'pipeline'=4,'context'=1,'tensor'=1] {'pipeline':(2)2}",
     "{{0,1},{2,3},{4,5},{6,7}}", ("pipeline",)),
    ("mesh['data'=2,'fsdp'=1,'pipeline'=4,'context'=1,'tensor'=1] {'data','fsdp'}",
     "{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
    ("[4,2]<=[2,4]T(1,0)", "{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
    ("{{4,0},{5,1},{6,2},{7,3}}", "{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
])
def test_inventory_reads_every_replica_group_notation(printed, expected, axes):
    """XLA's printer is no contract: each notation it has used gives the same groups."""
    mesh = par.make_mesh("pipeline=4,data=2")
    [row] = collectives(_one_collective(printed), mesh)
    assert (row.replica_groups, row.axes, row.group_size, row.bytes) == (expected, axes, 2, 256)


def test_inventory_from_the_module_proto_equals_the_one_from_text():
    _, _, compiled, placement, _ = sharded_run("gpt", "fsdp=8", "fsdp")
    text = getattr(compiled, "compiled", compiled).as_text()
    key = lambda r: (r.computation, r.name, r.kind)  # noqa: E731
    from_proto = sorted(collectives(compiled, placement.mesh), key=key)
    assert from_proto == sorted(collectives(text, placement.mesh), key=key)
    assert {r.effective_kind for r in from_proto} >= {"all-gather", "reduce-scatter"}


def test_report_prints_both_tables():
    _, _, compiled, placement, _ = sharded_run("gpt", "fsdp=8", "fsdp")
    for mesh in (None, placement.mesh):
        text = report(compiled, mesh=mesh)
        assert "all-reduce+slice (reduce-scatter on GPU/TPU)" in text and "arguments" in text
    assert "│ fsdp " in report(compiled, mesh=placement.mesh)
    with pytest.raises(ValueError, match="compiled program"):
        collectives(object())


@pytest.mark.parametrize("mesh, rules, rows", [("tensor=4", "tp", 8), ("data=2,tensor=4", "dp+tp", 4)])
def test_decode_step_collectives_equal_megatrons_count(mesh, rules, rows):
    """One compiled decode step (benchmarks/decode_collectives.py), batch 8, fp32, L=2, D=32, over
    4 tensor devices: per layer 2 all-reduces of the new position's [rows, D] (attention out, MLP
    down); once, the embedding's all-reduce and the greedy pick's all-gathers of each device's
    (max, id); `rows` per device. By hand: rows * 32 * 4 bytes, and rows * 4 devices * 4 bytes."""
    from test_benchmarks import load

    bench = load("decode_collectives")
    act, pick = rows * 32 * 4, rows * 4 * 4
    want = [("all-gather", pick, 2), ("all-reduce", act, 2 * 2 + 1)]
    model = eqx.filter_jit(lambda k: bench.nn.GPT(bench.SMALL, key=k))(jax.random.key(0))
    assert bench.measured(model, bench.strategy_of(mesh, rules), 8) == want
    assert bench.analytic(bench.SMALL, rows, 4) == want
