"""Test set-up: 8 simulated CPU devices and runtime type checking of all of eqgpt.

Both must happen before JAX or eqgpt is imported, so they live here, as does the XLA:CPU
optimisation level of every compile (below). Compiled
programs are released after each test module. (JAX's
persistent compilation cache is deliberately off: reading an entry another xdist
worker was writing crashed a worker with a segmentation fault on jax 0.10.2. The
recipe turns it on by default; EQGPT_NO_COMPILE_CACHE keeps it off in every recipe
run of the suite, in this process and in the subprocesses that inherit it, except the
`train_gpt.py` processes of test_overlap and test_resume: each xdist worker gives
its own, one after another, a cache of its own (`recipe_runs.subprocess_compile_cache`),
so that no two processes ever share one at a time.)
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# XLA:CPU's backend (LLVM) optimisation level 0 for every compile of the suite, here and in the
# recipe subprocesses that inherit the environment: the HLO, its sharding and its collectives are
# unchanged, the kernels are less optimised, and the suite (compile-bound: tiny models, few steps)
# runs about a sixth faster. Every comparison is between programs compiled alike.
#
# Where XLA:CPU still has its older loop emitters (jaxlib 0.10; 0.12 removed the flag, and an unknown
# flag aborts the process, so a child process asks first, once per session), they replace the MLIR
# fusion emitters: a composed strategy's step compiles in 2.0 s instead of 4.4 (same losses, bitwise).
FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if "EQGPT_TEST_XLA_FLAGS" not in os.environ:  # probed once; xdist workers inherit the answer
    os.environ["EQGPT_TEST_XLA_FLAGS"] = " ".join(
        ["--xla_backend_optimization_level=0", *([FAST_COMPILE] if _xla_accepts(FAST_COMPILE) else [])])
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {os.environ['EQGPT_TEST_XLA_FLAGS']}".strip()
os.environ["EQGPT_NO_COMPILE_CACHE"] = "1"
# The recipe restarts itself with glibc's malloc settings (`eqgpt.launch.GLIBC_MALLOC_TUNABLES`):
# right for long runs, which would fault their step buffers in again every step, but a suite run
# is a few steps, and huge pages cost it time: 2 to 3 s more system and wall time in a 14 s run.
# Set (even empty), the variable keeps the recipe subprocesses on glibc's defaults, without a restart.
os.environ.setdefault("GLIBC_TUNABLES", "")

import jax  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# Runtime type checks of the whole package: the hook stays installed for the session, so a module
# imported later (a kernel, a lazily imported part) is checked too, and every module is imported
# under it now, before any test file imports one unchecked (test_typecheck asserts it).
TYPECHECK_HOOK = install_import_hook("eqgpt", "typechecker.check")  # tests/typechecker.py


def import_every_module(package: str = "eqgpt") -> list[str]:
    """Import `package` and every module below it; their names."""
    import importlib
    import pkgutil

    root = importlib.import_module(package)
    return [package, *(importlib.import_module(m.name).__name__
                       for m in pkgutil.walk_packages(root.__path__, f"{package}."))]


EQGPT_MODULES = import_every_module()


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. An xdist worker otherwise keeps
    every program of every module it ran, and XLA:CPU in jax 0.12 has crashed (segmentation
    fault) compiling in such a long-lived process a step that compiles fine in a new one."""
    yield
    jax.clear_caches()


# The files holding the suite's longest tests (20 to 45 s each: recipe runs in subprocesses, several
# processes, kills and resumes), run first: a worker that drew one last would finish alone while
# the others sat idle (longest-first scheduling). Within a file, and after these, collection order.
SLOW_FILES_FIRST = ("test_faults.py", "test_multiprocess.py", "test_recipes_parallel.py", "test_resume.py",
                    "test_packing.py", "test_fit_and_head.py", "test_overlap.py", "test_recipes.py", "test_launch.py",
                    "test_strategies.py", "test_docs_commands.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))
