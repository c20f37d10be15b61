"""The step-time model: a compiled step, a slice and a calibration table -> seconds per step.

**Compute** (per device) is three classes, each at its calibrated efficiency (`calibration`):

- matmuls: the compiled program's matmul FLOPs (`eqgpt.profile.matmul_flops`, loops counted
  per iteration) at the efficiency of the measured matmul nearest the step's typical shape
  (tokens per device x width -> MLP width per tensor shard);
- a dropless MoE's grouped matmuls in a Pallas kernel (`megablox`, which the compiler counts no
  FLOPs for either): the routed experts' FLOPs (`6 x top_k x` an expert's matmul weights per
  token and MoE layer; 8 with full remat), split evenly over the devices, at the matmul efficiency;
- attention in a Pallas kernel (`flash`, `splash`: a custom call the compiler counts no FLOPs
  for): eqgpt's attention FLOPs (`6 T D` per token and layer; 8 with full remat, which runs the
  forward again) at the kernel's efficiency at that length;
- memory-bound work at the calibrated share of HBM bandwidth: the bytes the compiled program's
  other instructions move (elementwise fusions, reductions, copies, the optimizer update; each
  reads its operands and writes its result once, loops counted per iteration:
  `eqgpt.profile.memory_bound_bytes`). An estimate of traffic, named as such in every report.

**Collectives** (`eqgpt.profile.schedule`: every collective with its bytes, group, mesh axes,
executions per step and the compute scheduled under it). Each takes the bytes over the
bandwidth of the links its group spans, found from the devices' torus coordinates: a ring on
each torus axis it spans, both directions of every link (`2 W` an axis with wraparound, `W`
without: a line), summed over the axes; DCN per chip between slices. All-gather and
reduce-scatter move `(n-1)/n` of the bytes, an all-reduce twice that, an all-to-all `(n-1)/4`
of them (each chunk travels a quarter of the ring on average), a permute its bytes over one link.
An asynchronous collective with compute scheduled between its start and done hides up to that
compute's time.

Step time = compute + exposed collectives. Pipeline bubbles are in the compiled program (idle
stages compute on padding) and so in the FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eqgpt.config import GPTConfig
from eqgpt.plan.calibration import Calibration
from eqgpt.plan.slices import Slice
from eqgpt.profile import matmul_flops, memory_bound_bytes, schedule
from eqgpt.profile.flops import flops_per_token

ASSUMPTIONS = (
    "efficiencies measured on one v5e carry over to other generations by peak FLOP/s and HBM bandwidth",
    "memory-bound work moves the bytes of the compiled program's non-matmul instructions, each reading its "
    "operands and writing its result once (an estimate of traffic)",
    "a collective runs as rings on the torus axes its group spans (2W with wraparound, W without), DCN per chip "
    "across slices; no contention between collectives",
    "an asynchronous collective hides behind the compute scheduled between its start and done, nothing else does",
)


@dataclass(frozen=True)
class CollectiveTime:
    """One collective of the step: **fields** `kind`, `axes`, `link` ("ICI", "DCN", "chip"),
    `group`, `bytes` (per device, per execution), `executions`, `seconds` (all executions, alone),
    `hidden` (seconds under compute), `is_async`."""

    kind: str
    axes: tuple[str, ...] | None
    link: str
    group: int
    bytes: int
    executions: int
    seconds: float
    hidden: float
    is_async: bool

    @property
    def exposed(self) -> float:
        """Seconds not hidden under compute."""
        return self.seconds - self.hidden


@dataclass(frozen=True)
class Prediction:
    """A predicted step. **Fields:** seconds of `matmul`, `attention`, `memory_bound` work and
    `collectives` (each a `CollectiveTime`), the `step` seconds, `tokens_per_second`, `mfu`, the
    efficiencies used, the FLOPs (`compiled_flops` per device: matmuls; `analytic_flops` per
    device: eqgpt's count) and the `assumptions`."""

    matmul: float
    attention: float
    memory_bound: float
    collectives: tuple[CollectiveTime, ...]
    step: float
    tokens_per_second: float
    mfu: float
    matmul_efficiency: float
    attention_efficiency: float | None
    compiled_flops: int
    analytic_flops: float
    provisional: bool
    assumptions: tuple[str, ...] = field(default=ASSUMPTIONS)

    @property
    def compute(self) -> float:
        """Seconds of compute (matmuls, attention kernel, memory-bound work)."""
        return self.matmul + self.attention + self.memory_bound

    @property
    def exposed(self) -> float:
        """Seconds of communication not hidden under compute."""
        return sum(c.exposed for c in self.collectives)


def _span(mesh: Any, axes: tuple[str, ...], slice_: Slice) -> tuple[str, float]:
    """The link a group over `axes` uses and its bandwidth per device for ring collectives."""
    index = tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)
    devices = np.asarray(mesh.devices[index]).ravel()
    chip = slice_.chip
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        return "DCN", chip.dcn_bandwidth
    coords = np.array([d.coords for d in devices])
    full = (*slice_.shape, 1, 1)[: coords.shape[1]]
    bandwidth = 0.0
    for dim in range(coords.shape[1]):
        extent = len(set(coords[:, dim]))
        if extent > 1:
            wrap = extent == full[dim] and slice_.wraps(full[dim])
            bandwidth += chip.ici_bandwidth * (2 if wrap else 1)
    return ("ICI", bandwidth) if bandwidth else ("chip", math.inf)


def collective_seconds(kind: str, nbytes: float, group: int, link: str, bandwidth: float,
                       link_bandwidth: float) -> float:
    """Seconds of one collective of `nbytes` (the inventory's large side, per device) over `group` devices."""
    if math.isinf(bandwidth) or group <= 1:
        return 0.0
    share = (group - 1) / group
    if kind in ("all-gather", "reduce-scatter", "all-reduce+slice"):
        return nbytes * share / bandwidth
    if kind == "all-reduce":
        return 2 * nbytes * share / bandwidth
    if kind == "all-to-all":
        return nbytes * share / bandwidth if link == "DCN" else nbytes * (group - 1) / 4 / bandwidth
    return nbytes / (bandwidth if link == "DCN" else link_bandwidth)  # collective-permute: one link


def grouped_flops(cfg: GPTConfig, tokens: int) -> int:
    """FLOPs of a step's routed-expert matmuls over `tokens` (forward and backward; the forward again
    with full remat)."""
    m = cfg.moe
    per_width = (3 if cfg.mlp == "swiglu" else 2) * cfg.embed_dim
    weights = per_width * (m.expert_dim or cfg.hidden_dim) * m.top_k * (cfg.num_layers // m.every)
    return (8 if cfg.remat == "full" else 6) * tokens * weights


def predict(compiled: Any, *, mesh: Any, slice_: Slice, model_cfg: GPTConfig, batch_size: int, accum_steps: int,
            calibration: Calibration, pallas_attention: bool, pallas_grouped: bool = False,
            microbatches: int = 1) -> Prediction:
    """The predicted step of `compiled` (the planner's compile of the trainer's step) on `slice_`.

    **Arguments:** the compiled step and its `mesh`; the slice; the model config, global
    `batch_size`, `accum_steps` and pipeline `microbatches`; the `calibration` table;
    `pallas_attention` (attention runs in a Pallas kernel); `pallas_grouped` (a dropless MoE's
    grouped matmuls run in one).
    """
    chip = slice_.chip
    devices = mesh.devices.size
    peak = chip.peak_flops / chip.devices_per_chip
    hbm = chip.hbm_bandwidth / chip.devices_per_chip
    size = dict(mesh.shape)
    tokens = batch_size * model_cfg.seq_len
    token_split = size.get("data", 1) * size.get("fsdp", 1) * size.get("context", 1) * size.get("expert", 1)
    tensor = size.get("tensor", 1)
    m = max(1, tokens // (accum_steps * microbatches * token_split))
    mm_eff = calibration.matmul_efficiency(m, model_cfg.embed_dim, max(1, model_cfg.hidden_dim // tensor))
    flops = matmul_flops(compiled)
    if pallas_grouped and model_cfg.moe is not None:
        flops += grouped_flops(model_cfg, tokens) // devices
    t_matmul = flops / (peak * mm_eff)
    t_attention, attn_eff = 0.0, None
    if pallas_attention:
        per_token = (8 if model_cfg.remat == "full" else 6) * model_cfg.seq_len * model_cfg.embed_dim
        attn_flops = tokens * model_cfg.num_layers * per_token / devices
        attn_eff = calibration.attention_efficiency(model_cfg.seq_len // size.get("context", 1), model_cfg.head_dim)
        t_attention = attn_flops / (peak * attn_eff)
    t_memory = memory_bound_bytes(compiled) / (hbm * calibration.memory)
    rows = []
    for row in schedule(compiled, mesh=mesh):
        c = row.collective
        axes = tuple(c.axes or ())
        link, bandwidth = _span(mesh, axes, slice_) if axes else ("ICI", chip.ici_bandwidth)
        seconds = c.executions * collective_seconds(c.kind, c.bytes, c.group_size, link, bandwidth,
                                                    chip.ici_bandwidth)
        hidden = 0.0
        if c.is_async and row.overlap_flops > 0:
            hidden = min(seconds, c.executions * row.overlap_flops / (peak * mm_eff))
        rows.append(CollectiveTime(c.kind, c.axes, link, c.group_size, c.bytes, c.executions, seconds, hidden,
                                   c.is_async))
    step = t_matmul + t_attention + t_memory + sum(r.exposed for r in rows)
    per_second = tokens / step if step else 0.0
    chips = devices / chip.devices_per_chip
    analytic = tokens * flops_per_token(model_cfg) / devices
    return Prediction(t_matmul, t_attention, t_memory, tuple(rows), step, per_second,
                      per_second * flops_per_token(model_cfg) / (chip.peak_flops * chips), mm_eff, attn_eff,
                      flops, analytic, calibration.provisional)


__all__ = ["Prediction", "CollectiveTime", "predict", "grouped_flops", "collective_seconds", "ASSUMPTIONS"]
