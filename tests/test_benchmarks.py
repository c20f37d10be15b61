"""The benchmark scripts whose logic is more than timing: run small, on CPU."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@pytest.mark.parametrize("lhs, rhs, dims", [
    ((6, 4), (4, 5), (((1,), (0,)), ((), ()))),                # x @ w
    ((6, 4), (6, 5), (((0,), (0,)), ((), ()))),                # x.T @ dy (a weight gradient)
    ((2, 3, 6, 4), (2, 3, 5, 4), (((3,), (3,)), ((0, 1), (0, 1)))),  # attention scores
    ((2, 3, 6, 5), (2, 3, 6, 4), (((2,), (2,)), ((0, 1), (0, 1)))),  # p.T @ dO
])
def test_matmul_floor_writes_each_dot_general_as_the_same_einsum(lhs, rhs, dims):
    floor = load("matmul_floor")
    a, b = jax.random.normal(jax.random.key(0), lhs), jax.random.normal(jax.random.key(1), rhs)
    np.testing.assert_allclose(np.einsum(floor.einsum_spec(lhs, rhs, dims), a, b),
                               jax.lax.dot_general(a, b, dims), rtol=1e-5, atol=1e-5)


def test_matmul_floor_finds_every_matmul_of_the_step():
    floor = load("matmul_floor")

    def f(x, w):
        def layer(h, wi):
            return jnp.tanh(h @ wi), None
        return jax.lax.scan(layer, x, w)[0].sum()

    shapes = floor.dot_shapes(jax.make_jaxpr(jax.grad(f, argnums=1))(jnp.ones((3, 4)), jnp.ones((5, 4, 4))).jaxpr)
    assert sum(shapes.values()) == 5 * 3  # per layer: forward, and two in the backward pass


def test_accelerator_mfu_script_runs_on_cpu_when_asked(capsys):
    assert load("accelerator_mfu").main(["--cpu", "--preset", "nano", "--kernel", "reference", "--precision", "fp32",
                                 "--batch", "2", "--steps", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "step time" in out and "final loss" in out


def test_pipeline_balance_prints_equal_and_balanced_stages(capsys):
    assert load("pipeline_balance").main(["--preset", "nano", "--stages", "2", "--seq", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["split", "row", "stage", "0", "stage", "1", "slowest"]
    assert lines[2].split()[:2] == ["equal", "layers"] and lines[4].split()[:2] == ["auto", "layers"]
    assert sum(map(int, lines[4].split()[2:])) == 4  # nano's 4 layers, on the balanced split too


def test_compile_time_prints_each_phase_of_a_cold_and_a_warm_start(tmp_path, capsys):
    args = ["--preset", "nano", "--vocab", "256", "--seq", "32", "--layers", "2", "--cases", "1 device",
            "--cache", str(tmp_path)]
    assert load("compile_time").main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("1 device")]
    assert [r[-2:] for r in rows] == [["cold", "compiled"], ["warm", "cached"]]  # JAX's cache-hit event
    (cold, warm) = [dict(zip(["construct", "init", "trace", "lower", "compile", "ready"], map(float, r[3:9]),
                             strict=True))
                    for r in rows]
    for r in (cold, warm):  # the phases add up to the time to a compiled step
        assert abs(sum(v for k, v in r.items() if k != "ready") - r["ready"]) < 0.05, r


def test_matmul_floor_reads_the_matmuls_of_the_whole_training_step():
    import equinox as eqx

    import eqgpt
    from eqgpt.data.batch import Batch
    from eqgpt.nn import lm_loss

    floor = load("matmul_floor")
    cfg = eqgpt.GPTConfig(vocab_size=32, seq_len=16, num_layers=2, num_heads=2, embed_dim=16, use_bias=False,
                          tie_embeddings=True, attention_kernel="reference")
    _, jaxpr = floor.training_step(cfg, 2)  # traced, not compiled
    step = floor.dot_shapes(jaxpr)
    batch = Batch.from_windows(np.zeros((2, 17), np.int32))
    grad = eqx.filter_grad(lambda m: lm_loss(m, jnp.asarray(batch.tokens), jnp.asarray(batch.targets))[0])
    model = eqx.filter_eval_shape(lambda: eqgpt.nn.GPT(cfg, key=jax.random.key(0)))
    assert step == floor.dot_shapes(jax.make_jaxpr(grad)(model).jaxpr)  # forward + backward; the update has none
    assert sum(step.values()) > 2 * 3 * 6  # per layer at least q, k, v, o, up, down, each 3 times
def test_grouped_matmul_speed_prints_both_kernels_on_cpu_when_asked(capsys):
    assert load("grouped_matmul_speed").main(["--cpu", "--tokens", "128", "--experts", "4", "--embed", "128",
                                              "--hidden", "128", "--repeats", "1"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.split() == ["experts", "ragged_dot", "megablox"] and len(row.split()) == 3


def test_attention_speed_prints_the_cpu_table_when_asked(capsys):
    assert load("attention_speed").main(["--cpu", "--seqs", "128", "--tokens", "256", "--repeats", "1"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.split() == ["T", "batch", "reference", "blockwise"] and row.split()[:2] == ["128", "2"]


@pytest.mark.slow
def test_compile_diff_compiles_the_recipe_step_in_the_recipe_process(capsys):
    """The recipe's step (its optimizer, strategy, model_like and initial state) with its malloc
    settings and cache: each child process ran with the GLIBC_TUNABLES its row names (else it raises)."""
    args = ["--preset", "nano", "--layers", "1", "--batch", "2", "--copies", "1", "--variants", "bench,recipe+env"]
    assert load("compile_diff").main(args) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == ["bench", "recipe+env"]
    assert rows["recipe+env"][1:7] == ["recipe", "single", "True", "recipe", "eqgpt", "on"]
    for r in rows.values():  # the initial state's and the compile's seconds; the CPU's attention
        assert float(r[7]) > 0 and float(r[10]) > 0 and "no Pallas call" in " ".join(r), r


def test_matmul_in_step_times_the_pair_and_a_layers_forward_and_backward(capsys):
    assert load("matmul_in_step").main(["--quick", "--repeats", "1", "--target-ms", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[3:-3] for r in rows] == [["pair"], ["fwd+bwd"], ["gelu", "fwd+bwd"]]
    assert all(r[:3] == ["64", "128", "256"] and float(r[-1].rstrip("%")) > 0 for r in rows)


def test_init_compile_compiles_the_recipes_initialiser(capsys):
    assert load("init_compile").main(["--presets", "nano", "--topology", "", "--precision", "fp32"]) == 0
    name, params, lower, compile_ = capsys.readouterr().out.splitlines()[-1].split()
    assert name == "nano" and params.endswith("M") and float(lower) > 0 and float(compile_) > 0
