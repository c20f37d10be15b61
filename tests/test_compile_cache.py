"""The recipe's start-up choices that cut compile time: the persistent compilation cache
(on by default, off in this suite) and scanned layers for deep models."""

import json
import os
import subprocess
import sys

import jax
import pytest
import tyro

from eqgpt.compile_cache import COMPILE_CACHE_BYTES
from eqgpt.parallel.flags import tyro_registry
from recipe_runs import RECIPES, load_recipe

# In a fresh process (the cache must be set before the first compile, and this suite keeps
# it off in its own processes): the recipe's flags -> use_compile_cache, then one program
# compiled twice, the second time from a new in-memory cache, so only the disk can serve it.
CHILD = """
import importlib.util, json, sys
import jax, tyro
from eqgpt.parallel.flags import tyro_registry
spec = importlib.util.spec_from_file_location("recipe_cache_child", sys.argv[1])
recipe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recipe
spec.loader.exec_module(recipe)
path = recipe.use_compile_cache(tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=sys.argv[2:]))
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
f = lambda x: (x @ x.T).sum()
jax.jit(f)(jax.numpy.ones((8, 8))).block_until_ready()
jax.clear_caches()
jax.jit(f)(jax.numpy.ones((8, 8))).block_until_ready()
print(json.dumps({"path": None if path is None else str(path), "hits": len(hits),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def test_recipe_caches_compiled_programs_by_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("EQGPT_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(RECIPES / "train_gpt.py")], capture_output=True, text=True,
                         env={**env, "EQGPT_CACHE": str(tmp_path)}, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["path"] == str(tmp_path / "xla")  # the documented directory, under $EQGPT_CACHE
    assert got["hits"] >= 1 and any(p.name.endswith("-cache") for p in (tmp_path / "xla").iterdir())
    assert got["max_size"] == COMPILE_CACHE_BYTES  # bounded, so JAX locks each read and write


def test_recipe_compile_cache_flags(tmp_path, monkeypatch):
    recipe = load_recipe()
    parse = lambda *args: tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=list(args))  # noqa: E731
    assert parse("--compile-cache-dir", str(tmp_path)).compile_cache_dir == tmp_path
    assert recipe.use_compile_cache(parse("--no-compile-cache")) is None  # off: JAX's settings untouched
    assert os.environ["EQGPT_NO_COMPILE_CACHE"]  # how this suite keeps it off (tests/conftest.py)
    assert recipe.use_compile_cache(parse()) is None
    assert jax.config.jax_compilation_cache_dir == os.environ.get("JAX_COMPILATION_CACHE_DIR")  # untouched


@pytest.mark.parametrize("args, scanned", [
    ([], False),                                         # nano: 4 layers, unrolled (faster CPU steps)
    (["--model.scan-layers"], True),
    (["--model.num-layers", "8"], False),
    (["--model.num-layers", "9"], True),
    (["--model.preset", "gpt2-small"], True),            # 12 layers: scanned, compiles faster
    (["--model.preset", "gpt2-xl"], True),
])
def test_recipe_scans_the_layers_of_deep_models(args, scanned):
    recipe = load_recipe()
    assert tyro.cli(recipe.TrainConfig, registry=tyro_registry(), args=args).model.build().scan_layers is scanned
