"""Host offload of the optimizer state (and the parameters): they live in pinned host memory between steps.

AdamW keeps two fp32 moments per parameter, twice the parameters' own bytes. With
`Offload(opt_state=True)` those arrays stay in the `pinned_host` memory of
each device's host (same sharding, other memory kind): the compiled step copies them
to the device for the update and back afterwards. Device memory between steps drops
by the optimizer state's bytes; each step moves them host -> device -> host once
(`2 x 8 bytes` per local parameter for AdamW), which a GPU overlaps with compute.

`Offload(params=True)` does the same with the model's arrays (under FSDP
each device's shard): they are copied to the device before the forward pass, and
the updated arrays back after the update (4 bytes each way per local fp32 parameter).
Between steps the device then holds neither; inside the step, as without offload.

The part only says where (`Part.memory_kind`: `pinned_host`); `Strategy` moves the
arrays there, and into device memory and back for each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import jax

from eqgpt.parallel.part import Part

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

HOST = "pinned_host"


def check_host_memory() -> None:
    """A `ValueError` where the devices have no pinned host memory to offload to."""
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if HOST not in kinds:
        raise ValueError(f"host offload needs {HOST!r} memory, and {jax.devices()[0].platform} devices "
                         f"offer only {sorted(kinds)}; drop offload_opt_state and offload_params "
                         "(--offload-opt-state, --offload-params).")


@dataclass(frozen=True)
class Offload(Part):
    """What lives in pinned host memory between steps: `Offload(opt_state=True, params=False)`."""

    opt_state: bool = False
    """Keep the optimizer state in pinned host memory between steps (docs/memory.md)."""
    params: bool = False
    """Keep the parameters in pinned host memory between steps too (with FSDP, each device's shard; docs/memory.md)."""

    name = "offload"
    order = 60
    needs_mesh = False

    def validate(self, strategy: Strategy) -> None:
        check_host_memory()

    def memory_kind(self, strategy: Strategy, what: Literal["params", "opt_state"]) -> str | None:
        return HOST if getattr(self, what) else None  # the fields are named after what they keep

    def describe(self, strategy: Strategy) -> str:
        on_host = [what for what, flag in (("parameters", self.params), ("optimizer state", self.opt_state)) if flag]
        return f"{' and '.join(on_host)} on host"


__all__ = ["HOST", "Offload", "check_host_memory"]
