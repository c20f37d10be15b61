"""Per-device memory of a compiled program, from XLA's `memory_analysis()`.

- `argument_bytes`: inputs (parameters, optimizer state, batch) held by one device.
- `output_bytes`: outputs; `alias_bytes` of them reuse donated input buffers.
- `temp_bytes`: scratch XLA allocates while the program runs (activations kept
  for the backward pass, gathered weights, fusion buffers).
- `peak_bytes`: XLA's own peak figure where the backend reports one, else
  `argument + output - alias + temp` (an upper bound: live ranges are ignored).
- `host_argument_bytes`: the inputs that live in host memory (`pinned_host`, e.g.
  an offloaded optimizer state), read from the program's entry layout (memory
  space `S(5)`), since the CPU backend counts them in `argument_bytes` too;
  `device_argument_bytes` is the rest.

The CPU backend reports the same buffer assignment the GPU/TPU compilers would
make from the same HLO only approximately (fusion decisions differ), so treat CPU
`temp_bytes` as indicative; argument and output bytes follow from the shardings
alone and are exact on every backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from eqgpt.profile.hlo import nbytes  # one table of HLO dtype sizes
from eqgpt.profile.text import table_text


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one compiled program (see module docs for each field)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    peak_bytes: int
    host_bytes: int
    host_argument_bytes: int = 0

    @property
    def device_argument_bytes(self) -> int:
        return self.argument_bytes - self.host_argument_bytes

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("arguments", self.argument_bytes), ("  of which in host memory", self.host_argument_bytes),
            ("outputs", self.output_bytes),
            ("aliased (donated)", self.alias_bytes), ("temporaries", self.temp_bytes),
            ("generated code", self.code_bytes), ("peak (XLA estimate)", self.peak_bytes),
            ("host", self.host_bytes),
        ]


def _unwrap(compiled: Any) -> Any:
    inner = getattr(compiled, "compiled", None)  # equinox's Compiled wraps jax's
    if inner is not None and hasattr(inner, "memory_analysis"):
        return inner
    if not hasattr(compiled, "memory_analysis"):
        raise ValueError(
            f"memory() needs a compiled program (jax.jit(f).lower(...).compile()); got {type(compiled).__name__}."
        )
    return compiled


def memory(compiled: Any) -> MemoryReport:
    """The per-device memory of `compiled`.

    **Arguments:** `compiled`, from `jax.jit(f).lower(...).compile()` or
    `eqx.filter_jit(f).lower(...).compile()`.

    **Returns:** a `MemoryReport`. Raises `ValueError` if the backend gives no analysis.
    """
    stats = _unwrap(compiled).memory_analysis()
    if stats is None:
        raise ValueError("this backend returned no memory analysis for the program.")
    arg, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
    alias, temp = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    peak = getattr(stats, "peak_memory_in_bytes", 0) or (arg + out - alias + temp)
    host = sum(getattr(stats, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "temp"))
    host_args = getattr(stats, "host_argument_size_in_bytes", 0)
    if not host_args:  # the CPU backend counts host-memory inputs as arguments: read them off the layout
        arg_host = _host_argument_bytes(_unwrap(compiled).as_text())
        host_args, host = arg_host, host or arg_host
    return MemoryReport(arg, out, alias, temp, stats.generated_code_size_in_bytes, peak, host, host_args)


def _host_argument_bytes(hlo_text: str) -> int:
    """Bytes of the entry parameters whose layout puts them in host memory (`S(5)`)."""
    match = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
    if match is None:
        return 0
    total = 0
    for dtype, dims, layout in re.findall(r"(\w+)\[([\d,]*)\]\{([^}]*)\}", match.group(1)):
        if "S(5)" in layout:
            total += nbytes((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return total


def memory_table(compiled: Any, *, title: str = "memory per device") -> str:
    """A printable table (rich) of `memory(compiled)`."""
    from rich.table import Table

    report = compiled if isinstance(compiled, MemoryReport) else memory(compiled)
    table = Table(title=title)
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("MiB", justify="right")
    for name, value in report.rows():
        table.add_row(name, str(value), f"{value / 2**20:.3f}")
    return table_text(table, width=100)


__all__ = ["MemoryReport", "memory", "memory_table"]
