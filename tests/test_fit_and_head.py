"""The fused LM head + loss against a NumPy cross-entropy, and the memory check before the first step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqgpt.nn.loss import head_loss_sums
from eqgpt.nn.remat import POLICIES, remat_policy
from eqgpt.train.fit import DoesNotFit, check_fits

ROOT = Path(__file__).resolve().parents[1]


def numpy_head_loss(h, w, y, m, z_weight):
    """sum_i m_i * (lse_i - logit_{i, y_i} + z_weight * lse_i^2) in float64, from the definition."""
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    nll = lse - np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return float(np.sum(m * (nll + z_weight * lse**2))), float(np.sum(m * nll)), float(np.sum(m * lse**2))


@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_fused_head_loss_equals_the_definition_and_autodiff(z_weight):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 50, 16)).astype(np.float32)
    w = rng.normal(size=(40, 16)).astype(np.float32)
    y = rng.integers(0, 40, (3, 50))
    m = (rng.random((3, 50)) > 0.3).astype(np.float32)
    total, (nll, z, count) = head_loss_sums(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), loss_mask=jnp.asarray(m),
                                            chunk_size=16, z_loss=z_weight)
    want = numpy_head_loss(h, w, y, m, z_weight)
    np.testing.assert_allclose([float(total), float(nll), float(z)], want, rtol=2e-6)
    assert float(count) == m.sum()

    def fused(h, w):
        return head_loss_sums(h, w, jnp.asarray(y), loss_mask=jnp.asarray(m), chunk_size=16, z_loss=z_weight)[0]

    def plain(h, w):  # autodiff of the dense definition
        logits = h @ w.T
        lse = jax.nn.logsumexp(logits, -1)
        nll = lse - jnp.take_along_axis(logits, jnp.asarray(y)[..., None], -1)[..., 0]
        return jnp.sum(jnp.asarray(m) * (nll + z_weight * lse**2))

    got = jax.grad(fused, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    ref = jax.grad(plain, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    for a, b in zip(got, ref, strict=True):  # fp32, highest precision: measured <= 2e-6 of the largest entry
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_remat_policies_named_by_what_they_save():
    for name in ("none", "full", *POLICIES):
        assert name == "none" or name == "full" or remat_policy(name) is not None
    with pytest.raises(ValueError, match="save_qkv_proj"):
        remat_policy("save_everything")


def test_check_fits_names_the_gib_and_the_flags():
    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((256, 256))).compile()
    assert check_fits(lambda: compiled, limit=2**30) is compiled
    with pytest.raises(DoesNotFit, match=r"needs 0\.00 GiB.*0\.00 GiB available.*--batch-size.*--model\.remat"):
        check_fits(lambda: compiled, limit=1000)

    def compiler_out_of_memory():
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.07G of 15.75G hbm.")

    with pytest.raises(DoesNotFit, match=r"needs 20\.07 GiB of device memory \(15\.75 GiB available\)"):
        check_fits(compiler_out_of_memory, limit=2**34)

    def tpu_compiler_out_of_memory():  # as XLA:TPU (jax 0.10.2, v5e) words it: docs/measured/recipe_oom.txt
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                           "temporaries (20.66G) exceeds available HBM (15.75G).")

    with pytest.raises(DoesNotFit, match=r"needs 20\.66 GiB of device memory \(15\.75 GiB available\)"):
        check_fits(tpu_compiler_out_of_memory, limit=2**34)
    if jax.devices()[0].memory_stats() is None:  # the CPU: no known limit, nothing compiled
        assert check_fits(compiler_out_of_memory) is None


def recipe(tmp_path, *args, memory_gib):
    env = {**os.environ, "EQGPT_DEVICE_MEMORY_GIB": str(memory_gib), "PYTHONUNBUFFERED": "1", "JAX_LOG_COMPILES": "1"}
    cmd = [sys.executable, str(ROOT / "recipes" / "train_gpt.py"), "--steps", "2", "--eval-every", "0",
           "--sample-tokens", "0", "--no-progress", "--log-every", "1", *args]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_the_recipe_stops_before_training_when_the_step_cannot_fit(tmp_path):
    proc = recipe(tmp_path, "--batch-size", "64", memory_gib=0.01)
    assert proc.returncode == 1, proc.stderr[-2000:]
    # The estimate refuses it before the first compile (`check_memory`); the compiled step's own check
    # (`eqgpt.train.fit`, "error: the training step at --batch-size 64 needs ...") would refuse it next.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--batch-size 64" in errors[0] and "GiB" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_batch_size_auto_picks_a_batch_that_fits_and_trains(tmp_path):
    proc = recipe(tmp_path, "--batch-size", "auto", "--model.num-layers", "1", memory_gib=0.03)
    assert proc.returncode == 0, proc.stderr[-2000:]
    picked = [line for line in proc.stdout.splitlines() if line.startswith("--batch-size auto:")]
    assert picked and picked[-1].endswith("sequences per step"), proc.stdout[-2000:]
    # Each size tried compiles once (8 and 16 rows, then each predicted size), the chosen one included:
    # the run trains with the program 'auto' compiled for it.
    tried = {8, 16} | {int(line.split()[2]) for line in picked[:-1]}
    assert proc.stderr.count("Finished XLA compilation of jit(step)") == len(tried), picked
    assert (tmp_path / "runs" / "latest" / "summary.json").exists()
