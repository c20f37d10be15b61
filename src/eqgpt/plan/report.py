"""What `eqgpt-plan` prints for one compiled step: memory, FLOPs, collectives, overlap, predicted time.

`plan_record` gathers it as a JSON-ready dict (`--json`); `plan_text` renders the same dict
as tables.
"""

from __future__ import annotations

from typing import Any

from eqgpt.plan.model import Prediction
from eqgpt.plan.slices import GIB, Slice
from eqgpt.profile import memory
from eqgpt.profile.text import table_text
from eqgpt.train.fit import step_bytes


def plan_record(compiled: Any, prediction: Prediction, *, slice_: Slice, mesh: Any, describe: str,
                model: str, batch_size: int) -> dict[str, Any]:
    """Everything the plan reports about one compiled step, as plain data."""
    mem = memory(compiled)
    needed = step_bytes(compiled)
    p = prediction
    return {
        "slice": slice_.name, "topology": slice_.topology_name, "num_slices": slice_.num_slices,
        "devices": int(mesh.devices.size), "mesh": ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1),
        "strategy": describe, "model": model, "batch_size": batch_size,
        "memory": {"arguments": mem.device_argument_bytes, "temporaries": mem.temp_bytes,
                   "outputs": mem.output_bytes, "aliased": mem.alias_bytes, "needed": needed,
                   "hbm": slice_.chip.hbm_bytes // slice_.chip.devices_per_chip,
                   "fits": needed <= slice_.chip.hbm_bytes // slice_.chip.devices_per_chip},
        "flops": {"compiled_matmul": p.compiled_flops, "analytic": p.analytic_flops},
        "collectives": [{"kind": c.kind, "axes": list(c.axes or ()), "link": c.link, "group": c.group,
                         "bytes": c.bytes, "executions": c.executions, "seconds": c.seconds,
                         "hidden": c.hidden, "async": c.is_async} for c in p.collectives],
        "overlap": {"async": sum(c.is_async for c in p.collectives),
                    "under_compute": sum(c.hidden > 0 for c in p.collectives), "total": len(p.collectives)},
        "time": {"matmul": p.matmul, "attention": p.attention, "memory_bound": p.memory_bound,
                 "collectives_exposed": p.exposed, "step": p.step},
        "tokens_per_second": p.tokens_per_second, "mfu": p.mfu,
        "efficiency": {"matmul": p.matmul_efficiency, "attention": p.attention_efficiency},
        "calibration": "PROVISIONAL (not yet measured by benchmarks/plan_calibration.py)" if p.provisional
        else "measured", "assumptions": list(p.assumptions),
    }


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> str:
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*map(str, r))
    return table_text(table)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def plan_text(r: dict[str, Any]) -> str:
    """The tables of a `plan_record`."""
    m, t = r["memory"], r["time"]
    head = (f"{r['model']} on {r['slice']} ({r['topology']}{' x' + str(r['num_slices']) if r['num_slices'] > 1 else ''}"
            f", {r['devices']} devices), mesh {r['mesh'] or 'one device'}, {r['strategy']}, batch {r['batch_size']}")
    fits = "fits" if m["fits"] else "DOES NOT FIT"
    memory_rows = [["arguments (params, optimizer state, batch)", _mib(m["arguments"])],
                   ["temporaries", _mib(m["temporaries"])], ["outputs", _mib(m["outputs"])],
                   ["aliased (donated)", _mib(m["aliased"])],
                   [f"needed (arguments + temporaries): {fits}",
                    f"{m['needed'] / GIB:.2f} GiB of {m['hbm'] / GIB:.2f}"]]
    step = t["step"]
    groups: dict[tuple, list[float]] = {}
    for c in r["collectives"]:  # one row per kind, axes, link, group and async-ness
        key = (c["kind"], ",".join(c["axes"]) or "-", c["link"], c["group"], "yes" if c["async"] else "no")
        acc = groups.setdefault(key, [0, 0, 0, 0.0, 0.0])
        for i, v in enumerate((1, c["executions"], c["bytes"] * c["executions"], c["seconds"], c["hidden"])):
            acc[i] += v
    col_rows = [[kind, axes, link, group, ops, runs, _mib(total), is_async, f"{1e3 * sec:.2f}", f"{1e3 * hid:.2f}",
                 f"{100 * (sec - hid) / step:.1f}%" if step else "-"]
                for (kind, axes, link, group, is_async), (ops, runs, total, sec, hid)
                in sorted(groups.items(), key=lambda kv: -kv[1][3])]
    eff = r["efficiency"]
    time_rows = [["matmuls", f"{1e3 * t['matmul']:.2f}", f"at {100 * eff['matmul']:.1f}% of peak"],
                 ["attention kernel", f"{1e3 * t['attention']:.2f}",
                  "-" if eff["attention"] is None else f"at {100 * eff['attention']:.1f}% of peak"],
                 ["memory-bound work", f"{1e3 * t['memory_bound']:.2f}", "at the calibrated HBM share"],
                 ["collectives, exposed", f"{1e3 * t['collectives_exposed']:.2f}",
                  f"{r['overlap']['under_compute']} of {r['overlap']['total']} under compute "
                  f"({r['overlap']['async']} async)"],
                 ["step", f"{1e3 * step:.2f}", f"{r['tokens_per_second']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%"]]
    f = r["flops"]
    return "\n".join([
        head,
        _table("memory per device (MiB)", ["what", "MiB"], memory_rows),
        f"FLOPs per device and step: compiler's matmuls {f['compiled_matmul']:.3e}, eqgpt's analytic count "
        f"{f['analytic']:.3e} (ratio {f['compiled_matmul'] / max(f['analytic'], 1):.2f}; attention in a Pallas "
        "kernel is not in the compiler's count; remat adds to it)",
        _table("collectives per step (per device; --json lists each)",
               ["kind", "axes", "link", "group", "ops", "runs", "MiB", "async", "ms", "hidden ms", "exposed, of step"],
               col_rows),
        _table(f"predicted step ({r['calibration']} calibration)", ["part", "ms", "note"], time_rows),
        "assumptions: " + "; ".join(r["assumptions"]) + ".",
    ])


__all__ = ["plan_record", "plan_text"]
