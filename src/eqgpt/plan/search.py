"""The mesh search of `eqgpt-plan --mesh auto`: candidates, pruned by memory, ranked for compiling.

`candidates` lists the factorisations of a slice's devices over `data`, `fsdp`, `tensor` (with
sequence parallelism), `pipeline` (1F1B), `context` (ring, for sequences beyond 8192) and `expert` (MoE
models), each with remat `none` or `full` and, for pure data parallelism, ZeRO-1. It keeps those
the strategy accepts for the batch and whose memory estimate (`eqgpt.profile.estimate`, from
shapes, nothing compiled; conservative) is within `SLACK` times a device's HBM, and orders them by a rough analytic step
time (`rough_seconds`: model FLOPs at a flat efficiency, each axis's traffic over two ICI links,
the pipeline bubble). Only the ranking uses that rough time: the planner then compiles the first
few and predicts each with the full model (`eqgpt.plan.model`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from eqgpt.config import GPTConfig
from eqgpt.plan.slices import Slice
from eqgpt.profile.flops import flops_per_token

ROUGH_EFFICIENCY = 0.5  # of peak, for ranking only
# The estimate counts whole gradients and every activation the step could hold: above the compiled
# step (1.4x for llama-8b under fsdp=256 with full remat). It prunes what is far too big; the compile decides.
SLACK = 1.5


@dataclass(frozen=True)
class Candidate:
    """A mesh and flags to try. **Fields:** `sizes` (axis -> size), `rules`, `flags` (extra
    eqgpt-train flags, e.g. `{"pipeline": "1f1b", "microbatches": "8"}`), `remat`, `estimate`
    (bytes per device), `rough` (seconds, for ranking)."""

    sizes: tuple[tuple[str, int], ...]
    rules: str
    flags: tuple[tuple[str, str], ...]
    remat: str
    estimate: int = 0
    rough: float = math.inf

    @property
    def mesh(self) -> str:
        """The --mesh text."""
        return ",".join(f"{a}={n}" for a, n in self.sizes if n > 1) or "data=1"

    def args(self) -> list[str]:
        """The eqgpt-train flags of this candidate."""
        out = ["--mesh", self.mesh, "--strategy", self.rules, "--model.remat", self.remat or "none"]
        for k, v in self.flags:
            out += [f"--{k}", v]
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(n: int) -> list[int]:
    return [d for d in _divisors(n) if d & (d - 1) == 0]


def mesh_choices(cfg: GPTConfig, devices: int, batch_size: int) -> list[Candidate]:
    """Every factorisation this model and batch allow (before memory), with remat and ZeRO choices."""
    heads, kv = cfg.num_heads, cfg.kv_heads
    out = []
    tensors = [t for t in _powers(min(devices, 16)) if heads % t == 0 and kv % t == 0]
    pipes = [p for p in (1, 2, 4) if cfg.num_layers % p == 0 and devices % p == 0]
    contexts = [1, 2, 4] if cfg.seq_len > 8192 else [1]
    experts = [e for e in _powers(devices) if cfg.moe is not None and cfg.moe.num_experts % e == 0] or [1]
    for t, p, c, e in itertools.product(tensors, pipes, contexts, experts):
        rest = devices // (t * p * c * e) if devices % (t * p * c * e) == 0 else 0
        for f in (_powers(rest) if rest else []):
            d = rest // f
            rows = batch_size // (d * f * e * c)
            if batch_size % (d * f * e) or rows < 1:
                continue
            sizes = (("data", d), ("fsdp", f), ("pipeline", p), ("context", c), ("expert", e), ("tensor", t))
            rules = "+".join(r for r, on in (("dp", d > 1), ("fsdp", f > 1), ("sp", t > 1)) if on) or "dp"
            flags: list[tuple[str, str]] = []
            if p > 1:
                micro = 2 * p
                if (batch_size // (d * f * e)) % micro:
                    continue
                flags += [("pipeline", "1f1b"), ("microbatches", str(micro))]
            if c > 1:
                flags += [("context", "ring")]
            for remat in ("none", "full"):
                out.append(Candidate(sizes, rules, tuple(flags), remat))
                if d > 1 and f == 1 and t == 1 and p == 1:
                    out.append(Candidate(sizes, rules, (*flags, ("zero", "1")), remat))
    return out


def rough_seconds(c: Candidate, cfg: GPTConfig, slice_: Slice, batch_size: int, param_bytes: int = 4,
                  act_bytes: int = 2) -> float:
    """A rough step time for ranking: model FLOPs at `ROUGH_EFFICIENCY`, the traffic of each axis
    over two ICI links (DCN for `data` across slices), and the pipeline bubble."""
    size = dict(c.sizes)
    devices = math.prod(size.values())
    chip = slice_.chip
    tokens = batch_size * cfg.seq_len
    compute = tokens * flops_per_token(cfg) / devices / (chip.peak_flops / chip.devices_per_chip * ROUGH_EFFICIENCY)
    if c.remat == "full":
        compute *= 4 / 3
    p, t, f, d = size["pipeline"], size["tensor"], size["fsdp"], size["data"]
    micro = dict(c.flags).get("microbatches")
    if p > 1 and micro:
        compute *= (int(micro) + p - 1) / int(micro)
    link = 2 * chip.ici_bandwidth
    params = cfg.num_layers * 12 * cfg.embed_dim**2 + 2 * cfg.vocab_size * cfg.embed_dim  # rough, per model
    shard = params * param_bytes / (t * p)
    comm = 0.0
    if f > 1:
        comm += 3 * shard / d * (f - 1) / f / link  # gather fwd and bwd, reduce-scatter gradients
    if d > 1:
        bandwidth = chip.dcn_bandwidth if slice_.num_slices > 1 else link
        comm += 2 * shard / f * (d - 1) / d / bandwidth
    if t > 1:
        act = tokens / (d * f * size["context"] * size["expert"]) * cfg.embed_dim * act_bytes
        comm += 8 * cfg.num_layers / p * act * (t - 1) / t / link
    return compute + comm


def ranked(cands: list[Candidate], cfg: GPTConfig, slice_: Slice, batch_size: int, estimate_of: Any,
           hbm_bytes: int) -> list[Candidate]:
    """`cands` whose estimate `estimate_of(candidate) -> bytes` (`None`: the strategy refuses it) is within
    `SLACK` x `hbm_bytes`, fastest rough time first."""
    out = []
    for c in cands:
        need = estimate_of(c)
        if need is None or need > SLACK * hbm_bytes:
            continue
        out.append(dataclasses.replace(c, estimate=need, rough=rough_seconds(c, cfg, slice_, batch_size)))
    return sorted(out, key=lambda c: c.rough)


__all__ = ["Candidate", "mesh_choices", "rough_seconds", "ranked", "ROUGH_EFFICIENCY"]
