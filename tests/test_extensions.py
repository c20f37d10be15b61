"""A package outside the repo registers a kernel, a block and a preset; the console scripts train
with it (`--import`), sample it back from the recorded factory, and export a standard-block run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from eqgpt.cli import USER_ERROR_EXIT_CODE
from recipe_runs import console_script

PACKAGE = '''
import jax
import jax.numpy as jnp

import eqgpt
from eqgpt.nn import ActivationHook, Attention, Block, LayerNorm, Linear, NoConstraint, register_block
from eqgpt.nn.kernels import get_kernel, register_kernel
import equinox as eqx


def mine(q, k, v, **kw):
    """The reference kernel under another name."""
    return get_kernel("reference")(q, k, v, **kw)


class SquaredReLU(eqx.Module):
    up: Linear
    down: Linear
    shard: ActivationHook

    def __init__(self, dim, hidden, *, key):
        k1, k2 = jax.random.split(key)
        self.up = Linear(dim, hidden, axes=("embed", "mlp"), key=k1)
        self.down = Linear(hidden, dim, axes=("mlp", "embed"), key=k2)
        self.shard = NoConstraint()

    def __call__(self, x):
        return self.down(jnp.square(jax.nn.relu(self.up(self.shard(x, ("batch", "inner_seq", "embed"))))))


def block(config, *, key):
    ka, km = jax.random.split(key)
    attn = Attention(config.embed_dim, config.num_heads, kernel=config.attention_kernel, key=ka)
    return Block(LayerNorm(config.embed_dim), attn, LayerNorm(config.embed_dim),
                 SquaredReLU(config.embed_dim, 2 * config.embed_dim, key=km))


register_kernel("mine", mine)
register_block("squared-relu", block)
eqgpt.PRESETS["thatpkg-tiny"] = eqgpt.GPTConfig(seq_len=16, num_layers=1, num_heads=2, embed_dim=16)
'''

TINY = ["--steps", "2", "--batch-size", "4", "--log-every", "1", "--eval-every", "0", "--eval-windows", "2",
        "--sample-tokens", "3", "--sample-prompts", "a", "--no-progress", "--peak-flops", "1e12",
        "--no-compile-cache"]


script = console_script  # the console script `name` beside this Python, else `python -m`


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("ext")
    (root / "pkgs" / "thatpkg").mkdir(parents=True)
    (root / "pkgs" / "thatpkg" / "__init__.py").write_text(PACKAGE)
    (root / "corpus.txt").write_text("abcdefgh ijklmnop qrstuvwx\n" * 200)
    return root


def run(cmd: list[str], cwd: Path, with_package: bool) -> subprocess.CompletedProcess:
    paths = [str(cwd / "pkgs")] * with_package + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", "")}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_a_users_kernel_and_block_train_sample_and_are_recorded(setting, monkeypatch, capsys):
    out = run([*script("eqgpt-train"), "--import", "thatpkg", "--model.preset", "thatpkg-tiny",
               "--model.attention-kernel", "mine", "--model.block", "squared-relu", "--data.corpus", "corpus.txt",
               "--out-dir", "custom", *TINY], setting, with_package=True)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((setting / "custom" / "model_config.json").read_text())
    assert record["block_factory"] == "thatpkg:block" and record["attention_kernel"] == "mine"
    assert json.loads((setting / "custom" / "config.json").read_text())["recipe"]["imports"] == ["thatpkg"]
    sampled = run([*script("eqgpt-sample"), "--run-dir", "custom", "--prompt", "ab", "--max-new-tokens", "3",
                   "--num-samples", "1"], setting, with_package=True)
    assert sampled.returncode == 0 and "--- sample 0 ---\nab" in sampled.stdout, sampled.stderr[-3000:]
    assert "note:" not in sampled.stderr  # importing the recorded factory registered the kernel too
    missing = run([*script("eqgpt-sample"), "--run-dir", "custom"], setting, with_package=False)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().count("\n") == 0 and "thatpkg" in missing.stderr
    from eqgpt.interop.__main__ import main as interop

    monkeypatch.syspath_prepend(str(setting / "pkgs"))
    export = ["export", "--run", str(setting / "custom"), "--to", str(setting / "hf-custom")]
    assert interop(export) == USER_ERROR_EXIT_CODE
    assert "trained with block factory thatpkg:block" in capsys.readouterr().err


def test_a_registered_kernel_samples_as_reference_and_exports_without_its_package(setting):
    out = run([*script("eqgpt-train"), "--import", "thatpkg", "--model.preset", "thatpkg-tiny",
               "--model.attention-kernel", "mine", "--data.corpus", "corpus.txt", "--out-dir", "standard", *TINY],
              setting, with_package=True)
    assert out.returncode == 0, out.stderr[-3000:]
    sampled = run([*script("eqgpt-sample"), "--run-dir", "standard", "--prompt", "ab", "--max-new-tokens", "3",
                   "--num-samples", "1"], setting, with_package=False)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert "note: attention kernel 'mine' is not registered here; using 'reference'" in sampled.stderr
    from eqgpt.interop.__main__ import main as interop

    assert interop(["export", "--run", str(setting / "standard"), "--to", str(setting / "hf")]) == 0
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(setting / "hf")
    assert model.config.n_layer == 1


def test_a_bad_import_names_the_flag(setting, monkeypatch):
    from recipe_runs import load_recipe

    monkeypatch.chdir(setting)
    with pytest.raises(ValueError, match=r"^--import nothere: No module named 'nothere'; put its package on"):
        load_recipe().parse_flags(["--import", "nothere", "--out-dir", "x"])
    assert not (setting / "x").exists()


def test_the_console_scripts_are_declared_and_importable():
    import importlib
    import tomllib

    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"eqgpt-train", "eqgpt-sample", "eqgpt-plan"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name))
