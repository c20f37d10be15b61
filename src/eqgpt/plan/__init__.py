"""Planning for a slice we do not have: compile the training step for a TPU slice from shapes
(`compile`), report its memory, FLOPs and collectives, predict its step time from a calibration
table (`model`, `calibration`), and search meshes (`search`). `slices` is the catalogue.

Needs libtpu for the compile-only devices: `pip install 'eqgpt[tpu-plan]'`.
"""

from eqgpt.plan.slices import CHIPS, SLICES, Chip, Slice, has_libtpu, parse_slice

__all__ = ["CHIPS", "SLICES", "Chip", "Slice", "has_libtpu", "parse_slice"]
