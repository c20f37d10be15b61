"""The slice catalogue: TPU slices by name, with the figures the step-time model uses.

Chip figures are from the JAX scaling book, "How to Scale Your Model", chapter "How to
Think About TPUs" (https://jax-ml.github.io/scaling-book/tpus/, its `tpus.md`): peak bf16
FLOP/s, HBM capacity and bandwidth, ICI bandwidth per link and direction, the torus and its
wraparound, and DCN bandwidth per chip. The usable HBM of a v5e (15.75 GiB of its 16) is what
the chip's own out-of-memory errors report (`eqgpt.train.fit`); other generations keep the
same 1.6% reserve, an assumption.

A slice name is `GEN-N` (`v5e-16`: 16 chips; `v5p-128` and `v4-32` count TensorCores, two a
chip, as Google names them) or `Kx` before it for K slices joined by DCN (`2xv5e-256`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

GIB = 2**30
BOOK = "How to Scale Your Model, tpus.md (https://jax-ml.github.io/scaling-book/tpus/)"


@dataclass(frozen=True)
class Chip:
    """One TPU generation's chip.

    **Fields:** `name` (`"v5e"`), `topology` (libtpu's name, `"v5e"`), `peak_flops` (bf16 FLOP/s),
    `hbm_bytes` (usable), `hbm_bandwidth` (B/s), `ici_bandwidth` (B/s per link, one way),
    `torus_dims` (2 or 3), `wrap_from` (an axis of at least this many chips wraps around;
    `None`: never), `dcn_bandwidth` (B/s per chip, between slices), `accelerator_type` (the
    `TPU_ACCELERATOR_TYPE` prefix), `devices_per_chip` (JAX devices on one chip), `source`.
    """

    name: str
    topology: str
    peak_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    ici_bandwidth: float
    torus_dims: int
    wrap_from: int | None
    dcn_bandwidth: float
    accelerator_type: str
    devices_per_chip: int = 1
    source: str = BOOK


_RESERVE = 15.75 / 16  # usable share of HBM, measured on v5e (eqgpt.train.fit)
CHIPS: dict[str, Chip] = {
    # v5e: 197 TF/s bf16, 16 GB HBM at 8.1e11 B/s, 4 ICI links of 4.5e10 B/s one way (2D torus,
    # wraparound on the full 16-chip axes only), DCN 3.125e9 B/s per chip.
    "v5e": Chip("v5e", "v5e", 1.97e14, int(16 * GIB * _RESERVE), 8.1e11, 4.5e10, 2, 16, 3.125e9, "v5litepod"),
    # v5p: 459 TF/s, 96 GB HBM at 2.765e12 B/s, 6 links of 9e10 B/s one way (3D torus; wraparound on
    # axes of 16 chips, as the book's full-pod cube), DCN 6.25e9 B/s per chip.
    "v5p": Chip("v5p", "v5p", 4.59e14, int(96 * GIB * _RESERVE), 2.765e12, 9e10, 3, 16, 6.25e9, "v5p"),
    # v6e (Trillium): 918 TF/s, 32 GB HBM at 1.64e12 B/s, 4 links of 9e10 B/s (2D torus, wrap on
    # axes of 16), DCN 1.25e10 B/s per chip.
    "v6e": Chip("v6e", "v6e", 9.18e14, int(32 * GIB * _RESERVE), 1.64e12, 9e10, 2, 16, 1.25e10, "v6e"),
    # v4: 275 TF/s, 32 GB HBM at 1.2e12 B/s, 6 links of 4.5e10 B/s (3D torus, wrap on axes of 4 and
    # more: slices of whole 4x4x4 cubes), DCN 6.25e9 B/s per chip; JAX sees each TensorCore.
    "v4": Chip("v4", "v4", 2.75e14, int(32 * GIB * _RESERVE), 1.2e12, 4.5e10, 3, 4, 6.25e9, "v4", 2),
}

# Chips per slice -> the torus shape libtpu knows (`jax.experimental.topologies`).
_SHAPES = {
    2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    3: {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
        512: "8x8x8"},
}
# TensorCores per chip in the slice name (v5p-128 is 64 chips; v5e-16 is 16).
_NAME_CORES = {"v5e": 1, "v6e": 1, "v5p": 2, "v4": 2}
_NAME = re.compile(r"^(?:(\d+)x)?(v5e|v5p|v6e|v4)-(\d+)$")


@dataclass(frozen=True)
class Slice:
    """A slice (or several joined by DCN): its chip, torus shape and count.

    **Fields:** `name` (as given), `chip`, `shape` (chips along each torus axis), `num_slices`.
    """

    name: str
    chip: Chip
    shape: tuple[int, ...]
    num_slices: int = 1

    @property
    def chips(self) -> int:
        """Chips in all slices."""
        return math.prod(self.shape) * self.num_slices

    @property
    def topology_name(self) -> str:
        """libtpu's topology name, e.g. `"v5e:16x16"`."""
        return f"{self.chip.topology}:{'x'.join(map(str, self.shape))}"

    def wraps(self, axis_chips: int) -> bool:
        """Whether a torus axis of `axis_chips` chips has its wraparound link."""
        return self.chip.wrap_from is not None and axis_chips >= self.chip.wrap_from

    def devices(self) -> list:
        """Compile-only devices of this slice (`jax.experimental.topologies`; needs libtpu:
        `pip install 'eqgpt[tpu-plan]'`). Slices smaller than a host get host bounds of their own."""
        quiet_libtpu(self.chip)
        from jax.experimental import topologies

        kwargs = {}
        if self.num_slices > 1:
            kwargs["num_slices"] = self.num_slices
        if math.prod(self.shape) < 4:
            kwargs["chips_per_host_bounds"] = (*self.shape, 1)[:3] if len(self.shape) == 2 else self.shape
        return list(topologies.get_topology_desc(topology_name=self.topology_name, platform="tpu", **kwargs).devices)


def parse_slice(name: str) -> Slice:
    """The slice of a name such as `v5e-16`, `v5p-128` or `2xv5e-256`; `ValueError` naming `--slice` else."""
    m = _NAME.match(name.strip())
    if not m:
        raise ValueError(f"--slice {name!r}: write GEN-N (GEN one of {sorted(CHIPS)}, e.g. v5e-16, v5p-128) or "
                         "KxGEN-N for K slices joined by DCN (e.g. 2xv5e-256).")
    slices, gen, n = int(m.group(1) or 1), m.group(2), int(m.group(3))
    chip = CHIPS[gen]
    chips = n // _NAME_CORES[gen]
    shape = _SHAPES[chip.torus_dims].get(chips)
    if shape is None or n % _NAME_CORES[gen]:
        sizes = sorted(k * _NAME_CORES[gen] for k in _SHAPES[chip.torus_dims])
        raise ValueError(f"--slice {name!r}: {gen} slices come in sizes {sizes}.")
    if slices < 1:
        raise ValueError(f"--slice {name!r}: the number of slices must be at least 1.")
    return Slice(name, chip, tuple(int(x) for x in shape.split("x")), slices)


SLICES = ("v5e-16", "v5e-256", "v5p-128", "v6e-64", "v4-32", "2xv5e-256")


def has_tpu_chips() -> bool:
    """Whether this host has TPU chips of its own."""
    return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")


def quiet_libtpu(chip: Chip) -> None:
    """On a host without TPU chips, before libtpu loads for compile-only devices: name a host type so
    that it neither looks for a TPU worker nor prints warnings about one, and let several processes
    load it (test workers; a TPU host's own lock stays). JAX's backend stays the CPU's. A TPU host's
    own settings win."""
    if has_tpu_chips():
        return
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.accelerator_type}-{4 * chip.devices_per_chip}")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    if not os.environ.get("JAX_PLATFORMS") and not jax.config.values.get("jax_platforms"):
        try:
            jax.config.update("jax_platforms", "cpu")  # no chips: keep JAX from starting a TPU backend
        except Exception:  # noqa: BLE001  (a backend already started: it keeps its platforms)
            pass


def has_libtpu() -> bool:
    """Whether libtpu (the `tpu-plan` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


__all__ = ["Chip", "Slice", "CHIPS", "SLICES", "parse_slice", "has_libtpu", "quiet_libtpu", "GIB"]
