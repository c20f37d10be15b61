"""A run's learning-rate plan, as `config.json` records it, and the schedule it makes.

A plan is `{"planned_steps": N, "tails": [...]}`: warmup and cosine decay over N steps, then
each tail `{"from", "to", "tail"}` (`extend_schedule`) a resume past the plan's end added. A
resume recomputes the same schedule from the plan, so the learning rate at every step it
already trained is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import optax

from eqgpt.train.optim import extend_schedule, make_lr_schedule


def schedule_plan(out: Path | None, step: int | None, steps: int, extend: str) -> dict:
    """The plan of a run in `out` resumed at `step` to `steps`: the one its config.json records,
    with a tail (`extend`: cosine, linear or constant) when `steps` goes past its end; `extend`
    "restart", or no earlier run, makes a new plan over `steps`."""
    fresh = {"planned_steps": steps, "tails": []}
    saved = out / "config.json" if out is not None else None
    if not step or saved is None or not saved.is_file() or extend == "restart":
        return fresh
    record = json.loads(saved.read_text())
    plan = record.get("schedule") or {"planned_steps": record["recipe"]["steps"], "tails": []}
    end = plan["tails"][-1]["to"] if plan["tails"] else plan["planned_steps"]
    if steps <= end:
        return plan
    return {**plan, "tails": [*plan["tails"], {"from": step, "to": steps, "tail": extend}]}


def planned_schedule(plan: dict, *, lr: float, warmup_steps: int, min_lr_ratio: float) -> optax.Schedule:
    """The learning rate over `plan` (`schedule_plan`): warmup to `lr`, cosine decay to
    `lr * min_lr_ratio` at its `planned_steps`, then its tails."""
    total = plan["planned_steps"]
    schedule = make_lr_schedule(lr, total_steps=total, warmup_steps=min(warmup_steps, total - 1),
                                min_lr_ratio=min_lr_ratio)
    for tail in plan["tails"]:
        schedule = extend_schedule(schedule, start=tail["from"], end=tail["to"], final=lr * min_lr_ratio,
                                   tail=tail["tail"])
    return schedule


__all__ = ["planned_schedule", "schedule_plan"]
