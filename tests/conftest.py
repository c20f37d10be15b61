"""Test set-up: 8 simulated CPU devices, runtime type checking of eqgpt, a compile cache.

All must happen before JAX or eqgpt is imported, so they live here. JAX's
persistent compilation cache (in `.pytest_cache/xla`, shared by the xdist
workers) lets a program that several tests build (the same step compiled by
two recipe runs, say) compile once; a cached executable is the same program,
with the same memory analysis.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("XLA_FLAGS", "")

import jax  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
jax.config.update("jax_compilation_cache_dir", os.environ.get("EQGPT_TEST_XLA_CACHE", _CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

with install_import_hook("eqgpt", "beartype.beartype"):
    import eqgpt  # noqa: F401
    import eqgpt.nn  # noqa: F401
