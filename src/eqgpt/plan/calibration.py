"""The calibration table: how close to peak each class of operation runs on a real chip.

Three classes, each measured alone by `benchmarks/plan_calibration.py` (never a whole model):

- `matmul`: bf16 matmuls by shape `(m, k, n)`, efficiency = 2mkn / (time x peak);
- `attention`: the attention kernel (fwd + bwd, causal) by sequence length, efficiency =
  eqgpt's attention FLOPs (`6 T D` per token and layer, `eqgpt.profile.flops`) / (time x peak);
- `memory`: elementwise work, achieved bytes/s over the chip's HBM bandwidth.

A table is a JSON file per chip in this package's `calibration/` folder (`v5e.json`), written
by the benchmark with the command and output it came from. Other generations use the v5e
table: the efficiencies are taken to carry over when peak FLOP/s and HBM bandwidth scale,
an assumption the report names. A table with `"provisional": true` holds figures that were
not measured by the benchmark (its `"source"` says where they came from).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

MEASURED_ON = "v5e"


@dataclass(frozen=True)
class Calibration:
    """One chip's table. **Fields:** `chip`, `matmul` (rows of `m, k, n, efficiency`), `attention`
    (rows of `seq_len, efficiency`), `memory` (efficiency), `provisional`, `source`."""

    chip: str
    matmul: tuple[dict[str, float], ...]
    attention: tuple[dict[str, float], ...]
    memory: float
    provisional: bool
    source: str

    def matmul_efficiency(self, m: int, k: int, n: int) -> float:
        """The efficiency of the measured matmul nearest to `(m, k, n)` in log-shape distance."""
        def distance(row):
            return sum(math.log(max(a, 1) / row[key]) ** 2 for a, key in ((m, "m"), (k, "k"), (n, "n")))

        return min(self.matmul, key=distance)["efficiency"]

    def attention_efficiency(self, seq_len: int, head_dim: int | None = None) -> float:
        """The attention kernel's efficiency at `seq_len`, interpolated in log length (clamped at the ends),
        among the rows of the measured head size nearest `head_dim` (all rows without)."""
        rows = list(self.attention)
        if head_dim is not None and all("head_dim" in r for r in rows):
            nearest = min({r["head_dim"] for r in rows}, key=lambda d: abs(math.log(d / head_dim)))
            rows = [r for r in rows if r["head_dim"] == nearest]
        rows = sorted(rows, key=lambda r: r["seq_len"])
        if seq_len <= rows[0]["seq_len"]:
            return rows[0]["efficiency"]
        for lo, hi in zip(rows, rows[1:], strict=False):
            if seq_len <= hi["seq_len"]:
                w = math.log(seq_len / lo["seq_len"]) / math.log(hi["seq_len"] / lo["seq_len"])
                return lo["efficiency"] + w * (hi["efficiency"] - lo["efficiency"])
        return rows[-1]["efficiency"]


def from_dict(data: dict[str, Any]) -> Calibration:
    """A `Calibration` from the benchmark's JSON."""
    return Calibration(chip=data["chip"], matmul=tuple(data["matmul"]), attention=tuple(data["attention"]),
                       memory=float(data["memory"]["efficiency"]), provisional=bool(data.get("provisional")),
                       source=data.get("source", ""))


def load(chip: str = MEASURED_ON, path: str | Path | None = None) -> Calibration:
    """The table measured on `chip` (or read from `path`); chips without one use the v5e's."""
    if path is not None:
        return from_dict(json.loads(Path(path).read_text()))
    folder = resources.files("eqgpt.plan") / "calibration"
    name = f"{chip}.json" if (folder / f"{chip}.json").is_file() else f"{MEASURED_ON}.json"
    return from_dict(json.loads((folder / name).read_text()))


__all__ = ["Calibration", "load", "from_dict", "MEASURED_ON"]
