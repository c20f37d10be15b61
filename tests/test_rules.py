"""Rule sets, specs, placement, constraints and the guards (no training here)."""

import copy
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import eqgpt
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.profile import collectives, memory
from helpers import unchecked
from parallel_cases import CONFIGS, OPTIONS, reference_model

GPT_CFG = CONFIGS["gpt"]


def abstract(cfg=GPT_CFG):
    return eqx.filter_eval_shape(lambda: nn.GPT(cfg, key=jax.random.key(0)))


# --- rule tables -------------------------------------------------------------------

def test_presets_map_logical_names_as_documented():
    assert par.DP.spec(("batch", "seq"), "activations") == P("data", None)
    assert par.FSDP.spec(("embed", "mlp")) == P("fsdp", None)
    assert par.FSDP.spec(("batch", "seq", "embed"), "activations") == P(("data", "fsdp"), None, None)
    assert par.TP.spec(("embed", "heads")) == P(None, "tensor")
    assert par.SP.spec(("batch", "seq", "embed"), "activations") == P(None, "tensor", None)
    assert par.SP.spec(("batch", "inner_seq", "heads", "head_dim"), "activations") == P(None, None, "tensor", None)


def test_strategy_composition_is_a_union_independent_of_order():
    r = par.preset_rules("dp+fsdp+tp")
    assert r == par.preset_rules("tp+fsdp+dp")
    assert r.activations["batch"] == ("data", "fsdp")
    assert r.params["embed"] == ("fsdp",) and r.params["heads"] == ("tensor",)
    assert par.preset_rules("sp").params == par.TP.params  # sp implies tp
    assert par.preset_rules("fsdp+sp").activations["seq"] == ("tensor",)
    assert par.preset_rules(r) is r


def test_rules_are_frozen_hashable_and_updatable():
    r = par.preset_rules("fsdp")
    assert hash(r) == hash(par.preset_rules("fsdp")) and {r: 1}[par.preset_rules("fsdp")] == 1
    with pytest.raises(AttributeError):
        r.name = "x"
    assert pickle.loads(pickle.dumps(r)) == r and copy.deepcopy(r).name == "fsdp"
    u = r.update(params={"embed": None, "mlp": "fsdp"})
    assert u.axes("embed") == () and u.axes("mlp") == ("fsdp",) and r.axes("embed") == ("fsdp",)


def test_a_mesh_axis_is_used_once_per_spec():
    r = par.Rules(params={"embed": "tensor", "mlp": ("tensor", "fsdp")})
    assert r.spec(("embed", "mlp")) == P("tensor", "fsdp")
    assert r.spec(("mlp", "embed")) == P(("tensor", "fsdp"), None)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: par.preset_rules("dp+zero"), "unknown strategy"),
        (lambda: par.preset_rules(""), "empty strategy"),
        (lambda: par.Rules(params={"embed": "model"}), "unknown mesh axis 'model'"),
        (lambda: par.Rules(params={"embed": ("fsdp", "fsdp")}), "repeated"),
        (lambda: par.FSDP.spec(("embed",), kind="weights"), "kind must be"),
    ],
)
def test_bad_rules_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match), unchecked():  # as outside the suite: kind="weights" mistyped
        make()


def test_spec_with_a_mesh_drops_size_one_axes_and_checks_divisibility():
    mesh = par.make_mesh("fsdp=8")
    r = par.preset_rules("dp+fsdp+tp")
    assert r.spec(("batch", "seq"), "activations", mesh=mesh) == P("fsdp", None)
    with pytest.raises(ValueError, match=r"size 12, not divisible by mesh axes \('fsdp',\) of total size 8"):
        r.spec(("embed",), shape=(12,), mesh=mesh)
    # An activation the mesh cannot split (one sequence while decoding) is replicated.
    assert r.spec(("batch", "seq", "embed"), "activations", shape=(1, 4, 32), mesh=mesh) == P(None, None, None)
    tp8 = par.make_mesh("tensor=8")  # 4 kv heads * head_dim 4 over 8 ranks: replicated
    assert r.spec(("embed", "kv_heads"), shape=(32, 12), mesh=tp8) == P(None, None)


# --- model specs, overrides, constraints --------------------------------------------

def test_param_specs_follow_logical_axes_with_a_leading_layers_dim():
    specs = par.param_specs(abstract(), par.preset_rules("fsdp+tp"))
    assert specs.blocks.attn.q_proj.weight == P(None, "fsdp", "tensor")
    assert specs.blocks.attn.o_proj.weight == P(None, "tensor", "fsdp")
    assert specs.blocks.mlp.down.bias == P(None, "fsdp")
    assert specs.tok_embed.weight == P("tensor", "fsdp")
    assert specs.pos_embed.weight == P(None, "fsdp")


def test_overrides_apply_to_the_module_subtree_longest_prefix_first():
    tp = par.preset_rules("tp")
    overrides = {"blocks": par.preset_rules("fsdp"), "blocks.attn": tp}
    specs = par.param_specs(abstract(), par.REPLICATED, overrides)
    assert specs.blocks.attn.q_proj.weight == P(None, None, "tensor")
    assert specs.blocks.mlp.up.weight == P(None, "fsdp", None)
    assert specs.tok_embed.weight == P(None, None)
    model = par.with_constraints(abstract(), par.make_mesh("tensor=8"), par.REPLICATED, overrides)
    assert model.blocks.attn.shard.rules == tp and model.blocks.mlp.shard.rules == par.preset_rules("fsdp")
    assert model.shard.rules == par.REPLICATED and model.blocks.shard.rules == par.preset_rules("fsdp")
    with pytest.raises(ValueError, match="matches no array"):
        par.param_specs(abstract(), par.REPLICATED, {"blocks.atn": tp})


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_constraint_pins_activations_on_auto_and_explicit_meshes(axis_type):
    mesh = par.make_mesh("data=2,tensor=4", axis_types=axis_type)
    hook = par.ShardingConstraint(mesh, par.preset_rules("dp+sp"))
    x = jax.device_put(jnp.arange(8 * 16 * 4.0).reshape(8, 16, 4), NamedSharding(mesh, P()))
    y = jax.jit(lambda x: hook(x * 2, ("batch", "seq", "embed")))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor", None)), 3)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    with pytest.raises(ValueError, match="given 2 axis names"):
        hook(x, ("batch", "seq"))


# --- placement -----------------------------------------------------------------------

def test_init_sharded_equals_unsharded_init_and_never_holds_whole_weights():
    mesh = par.make_mesh("fsdp=4,tensor=2")
    rules = par.preset_rules("fsdp+tp")
    make = lambda k: nn.GPT(GPT_CFG, key=k)  # noqa: E731
    # The program init_sharded runs (init_sharded itself is trained against one
    # device in test_parallel_parity); compiled here to read its memory.
    compiled = par.lower_init(make, jax.random.key(0), mesh, rules).compile(OPTIONS)
    static = eqx.filter_eval_shape(make, jax.random.key(0))
    model = eqx.combine(compiled(jax.random.key(0)), eqx.filter(static, eqx.is_array, inverse=True))
    model = par.with_constraints(model, mesh, rules)
    ref = reference_model("gpt")
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ref, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert model.blocks.attn.q_proj.weight.sharding.spec == P(None, "fsdp", "tensor")
    assert isinstance(model.blocks.attn.shard, par.ShardingConstraint)
    # Each device writes only its share of the weights, gathers nothing, and its
    # scratch space stays far below the whole model.
    total = sum(x.size * 4 for x in jax.tree.leaves(eqx.filter(ref, eqx.is_array)))
    share = sum(x.addressable_shards[0].data.size * 4 for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    mem = memory(compiled)
    assert share <= mem.output_bytes <= 1.02 * share and share < total / 6
    assert mem.output_bytes + mem.temp_bytes < total / 2
    assert [c for c in collectives(compiled) if c.kind == "all-gather"] == []


def test_optimizer_moments_follow_their_parameters_and_scalars_replicate():
    mesh = par.make_mesh("fsdp=8")
    placement = par.ShardedPlacement(mesh, "fsdp")
    model = placement.place_model(reference_model("gpt"))
    opt = optax.adamw(1e-3)
    state = placement.init_opt_state(opt, model)
    adam = state[0]
    assert adam.mu.blocks.mlp.up.weight.sharding.spec == P(None, "fsdp", None)
    assert adam.nu.tok_embed.weight.sharding.spec == model.tok_embed.weight.sharding.spec
    assert adam.count.sharding.spec == P()
    moved = placement.place_opt_state(opt.init(eqx.filter(model, eqx.is_array)), model)
    assert moved[0].mu.blocks.attn.q_proj.weight.sharding == model.blocks.attn.q_proj.weight.sharding


def test_batches_are_global_arrays_split_over_data_and_fsdp():
    placement = par.ShardedPlacement(par.make_mesh("data=2,fsdp=2,tensor=2"), "dp+fsdp+sp")
    tokens = np.arange(8 * 32, dtype=np.int32).reshape(8, 32)
    batch = placement.batch({"x": tokens, "lengths": tokens[:, 0]})
    assert batch["x"].shape == (8, 32) and batch["x"].sharding.spec == P(("data", "fsdp"), "tensor")
    assert batch["lengths"].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(batch["x"]), tokens)
    windows = placement.batch(np.zeros((8, 33), np.int32))  # seq + 1 tokens: sequence kept whole
    assert windows.sharding.spec == P(("data", "fsdp"), None)
    with pytest.raises(ValueError, match="batch arrays must be"):
        placement.batch(tokens[None])
    with pytest.raises(ValueError, match="batch size 6 is not divisible by 4"):
        placement.batch(tokens[:6])


# --- guards --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "mesh, strategy, batch, seq, changes, match",
    [
        ("tensor=8", "tp", 8, 32, dict(num_heads=4), r"heads 4 is not divisible by 8"),
        ("data=2,fsdp=2,tensor=2", "dp+fsdp", 6, 32, {}, r"batch size 6 is not divisible by 4"),
        ("data=2,tensor=4", "dp+sp", 8, 30, {}, r"sequence length 30 is not divisible by 4"),
        ("tensor=8", "tp", 8, 32, dict(vocab_size=60), r"vocab_size 60 is not divisible by 8"),
        ("fsdp=8", "fsdp", 8, 32, dict(embed_dim=36, num_heads=4), r"embed_dim 36 is not divisible by 8"),
        ("tensor=8", "tp", 8, 32, dict(mlp_dim=100), r"mlp_dim 100 is not divisible by 8"),
    ],
)
def test_indivisible_sizes_raise_before_compile_naming_the_numbers(mesh, strategy, batch, seq, changes, match):
    with pytest.raises(ValueError, match=match):
        par.check_divisibility(GPT_CFG.replace(**changes), par.make_mesh(mesh), par.preset_rules(strategy), batch, seq)


def test_kv_heads_fewer_than_tensor_ranks_are_replicated_not_an_error():
    cfg = CONFIGS["llama"]  # 8 heads, 4 kv heads
    par.check_divisibility(cfg, par.make_mesh("tensor=8"), par.preset_rules("tp"), 8, 32)
    specs = par.param_specs(abstract(cfg), par.preset_rules("tp"), mesh=par.make_mesh("tensor=8"))
    assert specs.blocks.attn.k_proj.weight == P(None, None, None)
    assert specs.blocks.attn.q_proj.weight == P(None, None, "tensor")


def test_replication_guard_passes_fsdp_and_catches_a_rule_set_that_forgets_embed():
    model, mesh = abstract(), par.make_mesh("fsdp=8")
    frac = par.check_replication(model, mesh, par.preset_rules("fsdp"))
    assert 0 < frac < 0.02  # only the heads/mlp-sized biases stay whole
    assert par.check_replication(model, par.make_mesh("data=8"), par.preset_rules("dp")) == 0.0
    forgetful = par.Rules(params={"mlp": "fsdp"}, activations={"batch": "fsdp"}, name="mlp-only")
    with pytest.raises(ValueError, match=r"leave .*% of parameter bytes replicated .*blocks.attn"):
        par.check_replication(model, mesh, forgetful)


def test_gpt_config_is_still_importable_from_the_top_level():
    assert eqgpt.GPTConfig is type(GPT_CFG)
