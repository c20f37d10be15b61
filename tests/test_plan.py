"""Planning for a slice we do not have (`eqgpt.plan`, `eqgpt-plan`).

On CPU: the step lowers from shapes (`lower_from_shapes`) to the same program as from arrays;
kernels follow the platform being compiled for; the slice catalogue; the step-time model's
collective formulas. With libtpu (the `tpu-plan` extra, which CI installs): every strategy
family compiles for a v5e-16 through XLA:TPU, fits, and its collective inventory and matmul
FLOPs equal the analytic counts (`test_plan_families.py`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import eqgpt
from eqgpt.data.batch import Batch
from eqgpt.nn import GPT
from eqgpt.nn.kernels import auto_kernel_name
from eqgpt.nn.kernels.platform import compiling_for, interpret, target_platform
from eqgpt.nn.mask import CausalMask
from eqgpt.parallel import ParallelFlags
from eqgpt.plan.compile import compile_step
from eqgpt.plan.model import collective_seconds
from eqgpt.plan.slices import CHIPS, SLICES, parse_slice
from eqgpt.profile import collective_summary, memory
from eqgpt.train import Policy, TrainState, make_optimizer, make_train_step

TINY = eqgpt.GPTConfig(vocab_size=256, seq_len=128, num_layers=2, num_heads=4, embed_dim=128, tie_embeddings=False,
                       scan_layers=False)


@pytest.mark.slow
def test_step_lowers_from_shapes_to_the_program_it_compiles_from_arrays():
    strategy = ParallelFlags(mesh="data=2,fsdp=4", rules="dp+fsdp").strategy()
    policy, optimizer = Policy(), make_optimizer(1e-3)
    make = lambda k: GPT(TINY, key=k)  # noqa: E731
    from_shapes = compile_step(TINY, strategy, policy, optimizer, batch_size=16)
    model = strategy.init_model(make, jax.random.key(0))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    batch = strategy.batch(Batch.from_windows(np.zeros((16, TINY.seq_len + 1), np.int32)))
    step = make_train_step(optimizer, strategy=strategy, policy=policy, model_like=model)
    from_arrays = step.lower(state, batch).compile()
    shapes, arrays = memory(from_shapes), memory(from_arrays)
    # The same arguments, and outputs up to a few scalars (the key and counters a compiled-from-arrays
    # step returns as fresh buffers).
    assert shapes.argument_bytes == arrays.argument_bytes
    assert abs(shapes.output_bytes - arrays.output_bytes) <= 16
    summary = lambda c: [(r.kind, r.axes, r.bytes) for r in collective_summary(c, mesh=strategy.mesh)]  # noqa: E731
    assert summary(from_shapes) == summary(from_arrays) != []


def test_shape_batches_carry_the_strategy_sharding():
    strategy = ParallelFlags(mesh="data=8", rules="dp").strategy()
    windows = jax.ShapeDtypeStruct((16, 9), np.int32)
    batch = strategy.batch(jax.eval_shape(Batch.from_windows, windows))
    assert isinstance(batch.tokens, jax.ShapeDtypeStruct) and batch.tokens.shape == (16, 8)
    assert batch.tokens.sharding == strategy.batch(Batch.from_windows(np.zeros((16, 9), np.int32))).tokens.sharding


def test_kernels_follow_the_platform_compiled_for():
    assert target_platform() == "cpu" and interpret()
    assert auto_kernel_name(CausalMask(), 1024, 1024, np.dtype("float32")) == "blockwise"
    with compiling_for("tpu"):
        assert target_platform() == "tpu" and not interpret()
        assert auto_kernel_name(CausalMask(), 1024, 1024, jax.numpy.bfloat16) in ("flash", "splash")
    assert target_platform() == "cpu"


def test_slice_catalogue_names_shapes_and_wraparound():
    assert [parse_slice(n).chips for n in SLICES] == [16, 256, 64, 64, 16, 512]
    s = parse_slice("v5e-256")
    assert s.topology_name == "v5e:16x16" and s.wraps(16) and not s.wraps(8)
    assert parse_slice("2xv5e-256").num_slices == 2 and parse_slice("v5p-128").topology_name == "v5p:4x4x4"
    with pytest.raises(ValueError, match="--slice"):
        parse_slice("v5e-12")
    assert CHIPS["v5e"].peak_flops == 1.97e14 and CHIPS["v6e"].ici_bandwidth == 9e10


def test_collective_formulas():
    w = CHIPS["v5e"].ici_bandwidth
    # ring all-gather of V bytes over n devices moves (n-1)/n V per device; all-reduce twice that
    assert collective_seconds("all-gather", 16e6, 16, "ICI", 2 * w, w) == pytest.approx(15e6 / (2 * w))
    assert collective_seconds("all-reduce", 16e6, 16, "ICI", 2 * w, w) == pytest.approx(30e6 / (2 * w))
    assert collective_seconds("collective-permute", 1e6, 2, "ICI", 2 * w, w) == pytest.approx(1e6 / w)
    assert collective_seconds("all-gather", 1e6, 1, "ICI", w, w) == 0.0


@pytest.mark.slow
def test_a_step_that_does_not_fit_is_refused_with_the_trainers_error():
    from eqgpt.train.fit import DoesNotFit

    strategy = ParallelFlags(mesh="data=8", rules="dp").strategy()
    with pytest.raises(DoesNotFit, match=r"needs 0\.\d+ GiB of device memory \(0\.00 GiB available\)\. To fit, try"):
        compile_step(TINY, strategy, Policy(), make_optimizer(1e-3), batch_size=16, hbm_bytes=1024)


def test_missing_libtpu_is_one_line_naming_the_extra(monkeypatch, capsys):
    import eqgpt.cli.plan as cli_plan

    monkeypatch.setattr(cli_plan, "has_libtpu", lambda: False)
    with pytest.raises(SystemExit) as e:
        cli_plan.run(["--slice", "v5e-16", "--mesh", "fsdp=16"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err and "pip install 'eqgpt[tpu-plan]'" in err


def _benchmark(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_calibration_takes_the_steady_state_difference_not_the_call(monkeypatch):
    """A call of N iterations costs a fixed 0.6 ms plus 0.01 ms an iteration: the steady-state time
    per iteration is 0.01 ms, whatever the fixed cost, and N grows until N iterations take the target."""
    calibration = _benchmark("plan_calibration")
    monkeypatch.setattr(calibration, "median_seconds", lambda f, n, *a, repeats: 6e-4 + 1e-5 * int(n))
    seconds, n = calibration.steady_seconds(None, None, repeats=3, target_s=1e-3)
    assert seconds == pytest.approx(1e-5) and n * 1e-5 >= 1e-3 > n * 1e-5 / 2


@pytest.mark.slow
def test_calibration_benchmark_writes_a_table_the_planner_loads(tmp_path):
    from eqgpt.plan.calibration import load

    out = tmp_path / "cpu.json"
    args = ["--quick", "--repeats", "1", "--target-ms", "1", "--out", str(out)]
    assert _benchmark("plan_calibration").main(args) == 0
    table = load(path=out)
    shapes = {(r["m"], r["k"], r["n"]) for r in table.matmul}
    assert {(64, 128, 256), (64, 256, 128)} <= shapes and all(r["efficiency"] > 0 for r in table.matmul)
    assert [r["seq_len"] for r in table.attention] == [128, 256] and table.memory == 1.0 and not table.provisional
    assert table.matmul_efficiency(64, 128, 256) == next(r["efficiency"] for r in table.matmul if r["m"] == 64)


@pytest.mark.slow
def test_plan_vs_measured_compiles_predicts_and_runs_the_trainers_step(tmp_path, capsys):
    """The chip's check of the planner, in its CPU mode: the trainer's step for a tiny llama (bf16 master
    weights, full remat) is predicted, run, and written as a row whose parts add up to the prediction."""
    import json

    out = tmp_path / "pvm.txt"
    args = ["--quick", "--cases", "llama-1b", "--warmup", "1", "--steps", "1", "--out", str(out)]
    assert _benchmark("plan_vs_measured").main(args) == 0
    row = json.loads("[" + out.read_text().split("\n[", 1)[1])[0]  # the table, then the rows as JSON
    assert row["model"] == "llama-1b (quick)" and row["measured"] > 0 and row["matmul"] > 0
    assert row["predicted"] == pytest.approx(row["matmul"] + row["attention"] + row["memory_bound"]
                                             + row["collectives"])
    assert row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
    assert "llama-1b (quick)" in capsys.readouterr().out


def test_memory_bound_bytes_read_operands_write_results_and_slice_stacked_ones():
    """`x * 2 + 1` over n floats moves 8n bytes; a scan over L stacked rows (`x <- x * w_i + 1`) reads the
    row it slices, not the stack, each of its L iterations (3 rows of traffic, plus the carry's copies)."""
    import jax.numpy as jnp

    from eqgpt.profile import memory_bound_bytes

    n, layers = 1 << 14, 8
    assert memory_bound_bytes(jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(n)).compile()) == 8 * n
    scan = jax.jit(lambda ws, x: jax.lax.scan(lambda x, w: (x * w + 1.0, None), x, ws)[0])
    moved = memory_bound_bytes(scan.lower(jnp.ones((layers, n)), jnp.ones(n)).compile())
    assert 3 * layers * 4 * n <= moved < 4 * layers * 4 * n


def test_grouped_flops_count_the_routed_experts_of_each_moe_layer():
    from eqgpt.plan.model import grouped_flops

    cfg = eqgpt.preset("gpt2-small-moe")  # 12 MoE layers, top-2 of experts 1536 wide, GELU MLP (2 matmuls)
    assert grouped_flops(cfg, 1000) == 6 * 1000 * 12 * 2 * (2 * 768 * 1536)
    assert grouped_flops(cfg.replace(remat="full"), 1000) == 8 * 1000 * 12 * 2 * (2 * 768 * 1536)


def test_attention_efficiency_reads_the_rows_of_the_nearest_head_size():
    from eqgpt.plan.calibration import from_dict

    rows = [{"seq_len": t, "head_dim": d, "efficiency": e}
            for t, d, e in ((1024, 64, 0.1), (4096, 64, 0.2), (1024, 128, 0.3), (4096, 128, 0.5))]
    table = from_dict({"chip": "v5e", "matmul": [], "attention": rows, "memory": {"efficiency": 0.9}})
    assert table.attention_efficiency(4096, 128) == 0.5 and table.attention_efficiency(4096, 64) == 0.2
    assert table.attention_efficiency(2048, 96) == pytest.approx(0.4)  # 96 is nearer 128 in ratio; halfway in log T
    assert table.attention_efficiency(512, 64) == 0.1 and table.attention_efficiency(8192, 64) == 0.2  # clamped


def test_memory_bound_bytes_skip_arrays_the_compiler_keeps_on_chip():
    """XLA:TPU marks arrays it places in VMEM with `S(1)` in their layout: they move no HBM bytes."""
    from eqgpt.profile import memory_bound_bytes

    hlo = """HloModule m, is_scheduled=true

ENTRY %main (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %a = f32[1024]{0:S(1)} add(%p0, %p0)
  ROOT %b = f32[1024]{0} multiply(%a, %a)
}
"""
    assert memory_bound_bytes(hlo) == 2 * 4096 + 4096  # a reads p0 twice; b writes its result
