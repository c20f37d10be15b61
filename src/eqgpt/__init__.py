"""eqgpt: GPT models in JAX and Equinox, distributed and proven equal to one device."""

from eqgpt.config import PRESETS, GPTConfig, MoEConfig, preset

__version__ = "0.1.0"
__all__ = ["GPTConfig", "MoEConfig", "PRESETS", "preset", "__version__"]
