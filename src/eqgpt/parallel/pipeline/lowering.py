"""Lower a `Schedule` to per-tick instructions: what to run and which buffer slots to use.

The executor keeps two small buffers per device: stage *inputs* (activations that
arrived from the previous virtual stage, kept until that microbatch's backward
recomputes from them) and *gradients* (that arrived from the next virtual stage,
kept until the backward that consumes them). Slots are assigned here, once, by
walking the table in time order, so the buffer sizes are the schedule's true peak:
`m` inputs per stage for GPipe, at most `p` for 1F1B and ZB-H1.

In a split table (`Schedule.split_backward`) `B` (op `BACKWARD`: the input
gradient) reads both slots and frees neither; `W` (op `WEIGHT`: the weight
gradient, recomputed from the same input and incoming gradient) reads and frees
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eqgpt.parallel.pipeline.schedules import Schedule

# Instruction columns, and the op codes of column OP.
OP, MICROBATCH, CHUNK, ACT_READ, GRAD_READ, ACT_WRITE, GRAD_WRITE = range(7)
IDLE, FORWARD, BACKWARD, WEIGHT = range(4)


@dataclass(frozen=True)
class Lowered:
    """Instructions `[ticks, stages, 7]` (columns above) and the two buffer sizes.

    A write slot equal to the buffer size means "nothing arrives" (the executor
    writes with `mode="drop"`); reads of unused slots are never looked at.
    """

    instructions: np.ndarray
    act_slots: int
    grad_slots: int


def _allocate(free: list[int], size: list[int]) -> int:
    if free:
        return free.pop(0)
    size[0] += 1
    return size[0] - 1


def lower(schedule: Schedule) -> Lowered:
    """**Arguments:** a valid `schedule`. **Returns:** its `Lowered` instructions."""
    p, G = schedule.num_stages, schedule.num_virtual_stages
    T = schedule.num_ticks
    frees = "W" if schedule.split_backward else "B"  # the action done with the slots
    ins = np.zeros((T, p, 7), np.int32)
    act_of: list[dict] = [{} for _ in range(p)]
    grad_of: list[dict] = [{} for _ in range(p)]
    act_free: list[list[int]] = [[] for _ in range(p)]
    grad_free: list[list[int]] = [[] for _ in range(p)]
    act_size = [[0] for _ in range(p)]
    grad_size = [[0] for _ in range(p)]
    writes = []  # (tick, stage, column, slot), fixed up once the buffer sizes are known

    for t, row in enumerate(schedule.ticks):
        arrivals = []
        for s, a in enumerate(row):
            if a is None:
                continue
            g = a.chunk * p + s
            ins[t, s, :3] = ({"F": FORWARD, "B": BACKWARD, "W": WEIGHT}[a.kind], a.microbatch, a.chunk)
            key = (a.microbatch, g)
            if g:
                ins[t, s, ACT_READ] = act_of[s][key]
                if a.kind == frees:
                    act_free[s].append(act_of[s].pop(key))
            if a.kind != "F" and g < G - 1:
                ins[t, s, GRAD_READ] = grad_of[s][key]
                if a.kind == frees:
                    grad_free[s].append(grad_of[s].pop(key))
            if a.kind == "F" and g < G - 1:
                arrivals.append(("F", (g + 1) % p, (a.microbatch, g + 1)))
            if a.kind == "B" and g > 0:
                arrivals.append(("B", (g - 1) % p, (a.microbatch, g - 1)))
        # What is sent at tick t lands at the end of tick t, after the reads above.
        for kind, dst, key in arrivals:
            if kind == "F":
                slot = _allocate(act_free[dst], act_size[dst])
                act_of[dst][key] = slot
                writes.append((t, dst, ACT_WRITE, slot))
            else:
                slot = _allocate(grad_free[dst], grad_size[dst])
                grad_of[dst][key] = slot
                writes.append((t, dst, GRAD_WRITE, slot))
    # One buffer shape serves every stage (SPMD): the largest peak over stages.
    act_slots = max(1, *(n[0] for n in act_size))
    grad_slots = max(1, *(n[0] for n in grad_size))
    ins[:, :, ACT_WRITE] = act_slots
    ins[:, :, GRAD_WRITE] = grad_slots
    for t, s, col, slot in writes:
        ins[t, s, col] = slot
    return Lowered(ins, act_slots, grad_slots)
