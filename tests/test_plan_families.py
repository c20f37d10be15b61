"""Every strategy family compiled for a v5e-16 by XLA:TPU (libtpu's compile-only devices), from
shapes, through `eqgpt-plan`'s own path: it compiles, it fits, Pallas kernels lower as Mosaic
calls, and its collective inventory matches the analytic count.

The model is `nano` cut to 2 layers, fp32 parameters and compute (so bytes are 4 a value), one
compile per family (tens of seconds each); skipped, with the reason, where libtpu is absent
(CI installs it: the `test` extra).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import pytest

from eqgpt.nn import GPT
from eqgpt.plan.slices import has_libtpu, parse_slice
from eqgpt.profile import collectives, matmul_flops
from eqgpt.profile.flops import matmul_params
from eqgpt.train.fit import step_bytes

pytestmark = [pytest.mark.skipif(not has_libtpu(), reason="needs libtpu: pip install 'eqgpt[tpu-plan]'"),
              pytest.mark.slow]


def plan(*args: str):
    """eqgpt-plan's compile for a 2-layer nano on v5e-16: (compiled, strategy, model config)."""
    from eqgpt.cli import parse_cli
    from eqgpt.cli.plan import PlanConfig, compiled_plan

    cfg = parse_cli(PlanConfig, args=["--model.preset", "nano", "--model.num-layers", "2", "--precision", "fp32",
                                      "--slice", "v5e-16", *args])
    slice_ = parse_slice(cfg.slice)
    compiled, strategy, model_cfg, _ = compiled_plan(cfg, slice_, slice_.devices())
    assert step_bytes(compiled) <= slice_.chip.hbm_bytes  # fits (compiled_plan raised DoesNotFit otherwise)
    return compiled, strategy, model_cfg


def param_bytes(cfg) -> int:
    return 4 * sum(x.size for x in jax.tree.leaves(eqx.filter_eval_shape(GPT, cfg, key=jax.random.key(0))))


def weight_rows(rows):
    """Rows that move arrays, not the loss's and the gradient norm's scalars."""
    return [r for r in rows if not all(s.endswith("[]") for s in r.shapes)]


def test_dp_all_reduces_every_gradient_once():
    compiled, strategy, cfg = plan("--mesh", "data=16", "--batch-size", "32")
    rows = weight_rows(collectives(compiled, mesh=strategy.mesh))
    assert {(r.kind, r.axes) for r in rows} == {("all-reduce", ("data",))}
    # As on CPU (test_parallel_hlo): a tied table's two gradient contributions are reduced apart.
    table = 4 * cfg.vocab_size * cfg.embed_dim if cfg.tie_embeddings else 0
    assert sum(r.total_bytes for r in rows) == pytest.approx(param_bytes(cfg) + table, rel=1e-3)
    # Attention is a Pallas kernel (a Mosaic call, not interpreted loops); the matmuls are the weights'.
    assert "tpu_custom_call" in compiled.as_text()
    assert matmul_flops(compiled) == 6 * (32 * cfg.seq_len // 16) * matmul_params(cfg)


def test_fsdp_reduce_scatters_the_gradients():
    compiled, strategy, cfg = plan("--mesh", "fsdp=16", "--strategy", "fsdp", "--batch-size", "32")
    rows = weight_rows(collectives(compiled, mesh=strategy.mesh))
    assert {r.axes for r in rows} == {("fsdp",)}
    reduced = sum(r.total_bytes for r in rows if r.effective_kind in ("reduce-scatter", "all-reduce"))
    assert reduced == pytest.approx(param_bytes(cfg), rel=0.01)  # each gradient reduced once
    assert matmul_flops(compiled) == 6 * (32 * cfg.seq_len // 16) * matmul_params(cfg)


def test_fsdp_tp_sp_gathers_the_sequence_twice_a_layer():
    compiled, strategy, cfg = plan("--mesh", "fsdp=4,tensor=4", "--strategy", "fsdp+sp", "--batch-size", "16")
    rows = collectives(compiled, mesh=strategy.mesh)
    act = 16 // 4 * cfg.seq_len * cfg.embed_dim * 4  # a [rows, T, D] fp32 activation of one fsdp group
    gathers = [r for r in rows if r.kind == "all-gather" and r.axes == ("tensor",) and r.phase == "forward"]
    # Sequence parallelism: before attention and before the MLP, each layer gathers the sequence.
    assert sum(r.total_bytes for r in gathers) == 2 * cfg.num_layers * act


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_pipelines_send_one_microbatch_activation_per_hop(schedule):
    compiled, strategy, cfg = plan("--mesh", "pipeline=2,data=8", "--pipeline", schedule, "--microbatches", "4",
                                   "--batch-size", "32")
    rows = collectives(compiled, mesh=strategy.mesh)
    sends = [r for r in rows if r.kind == "collective-permute" and r.axes == ("pipeline",)]
    micro = 32 // 8 // 4 * cfg.seq_len * cfg.embed_dim * 4  # one microbatch's [rows, T, D] fp32 activation
    assert sends and {r.bytes for r in sends} == {micro}
    assert all(r.group_size == 2 for r in sends)


def test_ring_context_passes_each_key_value_block_around_the_ring():
    # The ring runs eqgpt's blockwise kernel on each device (eqgpt.parallel.context): no Pallas call.
    compiled, strategy, cfg = plan("--mesh", "context=2,data=8", "--context", "ring", "--model.seq-len", "512",
                                   "--model.attention-kernel", "flash", "--batch-size", "16")
    rows = collectives(compiled, mesh=strategy.mesh)
    block = 16 // 8 * (cfg.seq_len // 2) * cfg.embed_dim * 4  # one device's K (or V): [rows, T/c, H, hd] fp32
    sends = [r for r in rows if r.kind == "collective-permute" and r.phase == "forward" and r.bytes % block == 0]
    # Forward: K and V each take c - 1 = 1 step around the ring in every layer (however XLA combines them).
    assert sum(r.total_bytes for r in sends) == 2 * cfg.num_layers * block
    assert all(r.axes == ("context",) for r in sends)


def test_ulysses_context_exchanges_heads_for_the_sequence_around_flash():
    compiled, strategy, cfg = plan("--mesh", "context=4,data=4", "--context", "ulysses", "--model.seq-len", "512",
                                   "--model.attention-kernel", "flash", "--batch-size", "16")
    assert "tpu_custom_call" in compiled.as_text()  # flash, a Mosaic call, between the all-to-alls
    rows = collectives(compiled, mesh=strategy.mesh)
    shard = 16 // 4 * (cfg.seq_len // 4) * cfg.embed_dim * 4  # one device's [rows, T/c, D] fp32
    a2a = [r for r in rows if r.kind == "all-to-all" and r.phase == "forward"]
    # Forward: q, k and v to whole sequences of a quarter of the heads, and the output back, each layer.
    assert len(a2a) == 4 * cfg.num_layers and {(r.axes, r.bytes) for r in a2a} == {(("context",), shard)}


def _elements(shape: str) -> int:
    """Elements of an HLO array type such as `bf16[8,2,128,128]`."""
    return math.prod(int(n) for n in shape[shape.index("[") + 1: -1].split(",") if n)


def test_expert_parallel_dropless_moe_dispatches_and_combines_once_a_layer():
    compiled, strategy, cfg = plan("--mesh", "expert=4,data=4", "--model.preset", "moe-nano", "--model.dropless",
                                   "True", "--batch-size", "32")
    rows = collectives(compiled, mesh=strategy.mesh)
    a2a = [r for r in rows if r.kind == "all-to-all" and r.phase == "forward"]
    # Dropless: each device's rows have room for every token at every expert, exchanged there and back.
    room = cfg.moe.num_experts * (32 // 16) * cfg.seq_len * cfg.embed_dim
    assert len(a2a) == 2 * cfg.num_layers and all(r.axes == ("expert",) for r in a2a)
    assert {_elements(s) for r in a2a for s in r.shapes} == {room}
