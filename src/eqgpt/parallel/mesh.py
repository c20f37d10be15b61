"""Device meshes with the six named axes every eqgpt strategy speaks.

A mesh always has all six axes, in this order: `data, fsdp, pipeline, context,
expert, tensor`. Unused axes have size 1, so rule sets can name any axis on any mesh.
The order puts the axes that communicate least (data) outermost and those that
communicate most (tensor) innermost: with several hosts, `jax.devices()` lists
each host's devices together, so consecutive devices (the inner axes) share a
host and its fast links (`expert`, whose all-to-alls run in every MoE layer, sits
next to `tensor`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("data", "fsdp", "pipeline", "context", "expert", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the six mesh axes; one size may be `-1` (fill the remaining devices).

    **Fields:** `data`, `fsdp`, `pipeline`, `context`, `expert`, `tensor` (each >= 1, or -1).
    """

    data: int = 1
    fsdp: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.shape
        for name, size in zip(AXES, sizes, strict=True):
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"mesh axis {name}={size!r}: sizes must be positive integers or -1.")
        if sizes.count(-1) > 1:
            raise ValueError(f"at most one mesh axis may be -1 (fill), got {self}.")

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """Read `"data=2,fsdp=2,tensor=2"` (axes not named have size 1; `""` is all ones).

        **Arguments:** `text`, comma-separated `axis=size` pairs.

        **Returns:** the `MeshConfig`.
        """
        sizes: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in AXES:
                raise ValueError(
                    f"cannot read mesh entry {part!r} in {text!r}; write axis=size with axis one of {AXES}, "
                    'e.g. "data=2,tensor=4".'
                )
            if name in sizes:
                raise ValueError(f"mesh axis {name!r} given twice in {text!r}.")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {name}={value!r} in {text!r} is not an integer.") from None
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in `AXES` order (may contain -1 before `resolve`)."""
        return tuple(getattr(self, name) for name in AXES)

    @property
    def size(self) -> int:
        """Number of devices (only meaningful after `resolve`)."""
        return math.prod(self.shape)

    def resolve(self, num_devices: int) -> MeshConfig:
        """Replace a `-1` by what fills `num_devices`, and check the product.

        **Arguments:** `num_devices`, the total (global) device count.

        **Returns:** a `MeshConfig` whose sizes multiply to `num_devices`.
        """
        known = math.prod(s for s in self.shape if s != -1)
        if -1 in self.shape:
            if num_devices % known:
                raise ValueError(
                    f"mesh {self} cannot fill {num_devices} devices: the fixed axes multiply to "
                    f"{known}, which does not divide {num_devices}."
                )
            fill = next(n for n, s in zip(AXES, self.shape, strict=True) if s == -1)
            return dataclasses.replace(self, **{fill: num_devices // known})
        if known != num_devices:
            raise ValueError(
                f"mesh {self} has {known} devices but there are {num_devices}; choose sizes whose "
                f"product is {num_devices}, or set one axis to -1 to fill."
            )
        return self

    def __str__(self) -> str:
        parts = [f"{n}={s}" for n, s in zip(AXES, self.shape, strict=True) if s != 1]
        return ",".join(parts) or "single"


def make_mesh(
    config: MeshConfig | str | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    axis_types: AxisType | tuple[AxisType, ...] = AxisType.Auto,
) -> Mesh:
    """A `jax.sharding.Mesh` with axes `AXES`, over all (global) devices by default.

    **Arguments:**

    - `config`: a `MeshConfig`, its string form (`"data=2,tensor=4"`), or `None`
      for pure data parallelism (`data=-1`).
    - `devices`: the devices to use (default `jax.devices()`, all processes).
    - `axis_types`: `AxisType.Auto` (default: the compiler propagates shardings
      between constraints) or `AxisType.Explicit`, for every axis, or one per axis.

    **Returns:** the mesh. Raises `ValueError` when the sizes do not multiply to
    the device count.
    """
    if config is None:
        config = MeshConfig(data=-1)
    elif isinstance(config, str):
        config = MeshConfig.parse(config)
    devices = list(jax.devices() if devices is None else devices)
    config = config.resolve(len(devices))
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(AXES)
    if len(axis_types) != len(AXES):
        raise ValueError(f"axis_types needs one entry per mesh axis {AXES}, got {axis_types}.")
    # Keep each process's devices contiguous (outer axes span hosts, inner axes stay local).
    devices.sort(key=lambda d: (d.process_index, d.id))
    return jax.make_mesh(config.shape, AXES, axis_types=tuple(axis_types), devices=devices)


def mesh_config(mesh: Mesh) -> MeshConfig:
    """The `MeshConfig` of a mesh made by `make_mesh` (axes named as `AXES`)."""
    missing = [a for a in AXES if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build meshes with make_mesh.")
    return MeshConfig(**{a: mesh.shape[a] for a in AXES})
