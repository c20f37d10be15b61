"""Pipeline schedules as data: a table of what every stage does at every tick.

A schedule for `p` stages (devices), `m` microbatches and `v` chunks per stage is
a table `ticks x stages`. Each cell is an `Action` (forward or backward of one
microbatch through one chunk of layers) or `None` (the stage idles: a bubble).
A table may split every backward in two (zero-bubble schedules): `B`, the input
gradient, which the previous stage waits for, and `W`, the weight gradient,
which nobody waits for and so can fill a bubble.
The model's layer stack is cut into `G = p * v` *virtual stages* of equal depth;
virtual stage `g` lives on stage `g % p` as its chunk `g // p`, so with `v > 1`
each device holds `v` non-adjacent pieces of the network (Megatron's layout).

Time model: every action takes one tick; what a stage sends at tick `t` (an
activation forwards, a gradient backwards) can be used from tick `t + 1` on.
A table is valid when, for every microbatch `i` and virtual stage `g`:

- `F(i, g)` runs after `F(i, g - 1)`;
- `B(i, g)` runs after `B(i, g + 1)`, and `B(i, G - 1)` after `F(i, G - 1)`;
- in a split table, `W(i, g)` runs after `B(i, g)` (on the same stage).

`Schedule.__post_init__` checks this, so the executor
(`eqgpt.parallel.pipeline.executor`) can run any table a `Schedule` accepts.

The builders below list each stage's actions in order (the *program* of a
stage) and place them on the earliest ticks the dependencies allow
(`from_programs`):

- `gpipe`: all forwards, then all backwards. `m` stage inputs alive per stage.
- `one_f_one_b`: after `p - s - 1` warm-up forwards, stage `s` alternates one
  forward and one backward. At most `p` microbatches alive per stage.
- `interleaved`: 1F1B over `v` chunks per stage, in Megatron's order (groups of
  `p` microbatches per chunk); needs `m % p == 0`.
- `zero_bubble_h1` (ZB-H1, Qi et al. 2023): 1F1B's order of forwards and input
  gradients, with stage `s` running each weight gradient `s` backwards late
  (`W(k)` after `B(k + s)`, the rest at the end). The last stages' deferred `W`s
  fill the drain that 1F1B leaves idle, and every stage holds at most `p` stage
  inputs (1F1B's peak, on its first stage). Needs `m >= p`.

Idle cells: `2 p (p - 1)` for GPipe, 1F1B and interleaved (whose ticks are `1/v`
long), `p (p - 1)` for ZB-H1 (whose B and W take a tick each: the model
`T_F = T_B = T_W`). Bubble (idle ticks / all ticks): `(p - 1) / (m + p - 1)` for
GPipe and 1F1B, `(p - 1) / (v * m + p - 1)` interleaved, `(p - 1) / (3 m + p - 1)`
ZB-H1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")


@dataclass(frozen=True)
class Action:
    """One cell of a schedule: `kind` of `microbatch` through `chunk`.

    `kind` is "F" (forward), "B" (backward: the whole backward, or in a split
    table only the input gradient) or "W" (the weight gradient, split tables only).
    `chunk` is the chunk *on this stage* (0 .. v-1); the virtual stage is
    `chunk * num_stages + stage`.
    """

    kind: Literal["F", "B", "W"]
    microbatch: int
    chunk: int = 0

    def label(self, chunks: int) -> str:
        """`F3` (or `F3b`: microbatch 3, chunk 1, when stages hold several chunks)."""
        tail = "abcdefghijklmnopqrstuvwxyz"[self.chunk] if chunks > 1 else ""
        return f"{self.kind}{self.microbatch}{tail}"


Table = tuple[tuple[Action | None, ...], ...]


@dataclass(frozen=True)
class Schedule:
    """A validated schedule table (see the module docstring for the rules).

    **Fields:**

    - `name`: a label ("gpipe", "1f1b", "interleaved", "zb1" or your own).
    - `num_stages` (p), `num_microbatches` (m), `num_chunks` (v, chunks per stage).
    - `ticks`: the table, one row per tick with one `Action | None` per stage.

    The table is *split* (`split_backward`) when it has `W` actions; then it has
    one for every `B`.

    Raises `ValueError` if the table misses or repeats an action, puts one on the
    wrong stage, or breaks an ordering rule.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    ticks: Table

    def __post_init__(self):
        p, m, v = self.num_stages, self.num_microbatches, self.num_chunks
        if min(p, m, v) < 1:
            raise ValueError(f"stages, microbatches and chunks must be >= 1, got p={p}, m={m}, v={v}.")
        when: dict[tuple[str, int, int], int] = {}
        for t, row in enumerate(self.ticks):
            if len(row) != p:
                raise ValueError(f"tick {t} has {len(row)} cells for {p} stages.")
            for s, a in enumerate(row):
                if a is None:
                    continue
                if not (0 <= a.microbatch < m and 0 <= a.chunk < v and a.kind in ("F", "B", "W")):
                    raise ValueError(f"tick {t}, stage {s}: {a} is outside m={m}, v={v}.")
                key = (a.kind, a.microbatch, a.chunk * p + s)
                if key in when:
                    raise ValueError(f"{a.kind}{a.microbatch} of virtual stage {key[2]} appears twice.")
                when[key] = t
        G = p * v
        kinds = ("F", "B", "W") if any(k[0] == "W" for k in when) else ("F", "B")
        for i in range(m):
            for g in range(G):
                for kind in kinds:
                    if (kind, i, g) not in when:
                        raise ValueError(f"the table never runs {kind}{i} on virtual stage {g}.")
                if g and when["F", i, g] <= when["F", i, g - 1]:
                    raise ValueError(f"F{i} on virtual stage {g} does not follow F{i} on {g - 1}.")
                after = when["B", i, g + 1] if g < G - 1 else when["F", i, g]
                if when["B", i, g] <= after:
                    raise ValueError(f"B{i} on virtual stage {g} does not follow its dependency.")
                if "W" in kinds and when["W", i, g] <= when["B", i, g]:
                    raise ValueError(f"W{i} on virtual stage {g} does not follow B{i}.")

    # ------------------------------------------------------------------ queries

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into `B` (input gradient) and `W` (weight gradient)."""
        return any(a is not None and a.kind == "W" for row in self.ticks for a in row)

    def action(self, tick: int, stage: int) -> Action | None:
        return self.ticks[tick][stage]

    def program(self, stage: int) -> list[tuple[int, Action]]:
        """`(tick, action)` for every action of `stage`, in time order."""
        return [(t, row[stage]) for t, row in enumerate(self.ticks) if row[stage] is not None]

    @property
    def idle_ticks(self) -> int:
        return sum(a is None for row in self.ticks for a in row)

    @property
    def bubble(self) -> float:
        """Measured bubble fraction: idle cells over all cells of the table."""
        return self.idle_ticks / (self.num_ticks * self.num_stages)

    @property
    def expected_idle_ticks(self) -> int:
        """The analytic idle cells of the table: `2 p (p - 1)`, or `p (p - 1)` when split (ZB-H1).

        (A split table has `3 v m` busy ticks per stage instead of `2 v m`.)
        """
        p = self.num_stages
        return (1 if self.split_backward else 2) * p * (p - 1)

    @property
    def expected_bubble(self) -> float:
        """The analytic bubble, `expected_idle_ticks` over all cells: `(p - 1) / (v m + p - 1)`
        (GPipe, 1F1B, interleaved), `(p - 1) / (3 v m + p - 1)` when split (ZB-H1)."""
        p, m, v = self.num_stages, self.num_microbatches, self.num_chunks
        busy = (3 if self.split_backward else 2) * v * m * p
        return self.expected_idle_ticks / (self.expected_idle_ticks + busy)

    def in_flight(self, stage: int) -> int:
        """Most stage inputs `stage` holds at once: microbatch-chunks whose forward ran and whose
        backward (its `W` when split: the weight gradient recomputes from the input) has not."""
        done = "W" if self.split_backward else "B"
        alive = peak = 0
        for _, a in self.program(stage):
            alive += 1 if a.kind == "F" else -1 if a.kind == done else 0
            peak = max(peak, alive)
        return peak

    @property
    def peak_in_flight(self) -> int:
        """The most stage inputs any stage holds at once (`in_flight`): the activation memory, in stage inputs."""
        return max(self.in_flight(s) for s in range(self.num_stages))

    def table(self) -> str:
        """The time-by-stage chart: one row per stage, one column per tick, `.` idle."""
        labels = [[a.label(self.num_chunks) if a else "." for a in row] for row in self.ticks]
        width = max(len(x) for row in labels for x in row) + 1
        head = f"{self.name}: p={self.num_stages} m={self.num_microbatches}"
        head += f" v={self.num_chunks}" if self.num_chunks > 1 else ""
        head += f"  ticks={self.num_ticks}  idle={self.idle_ticks}  bubble={self.bubble:.3f}"
        head += f"  in-flight={self.peak_in_flight}"
        lines = [head, "tick    " + "".join(f"{t:<{width}}" for t in range(self.num_ticks)).rstrip()]
        for s in range(self.num_stages):
            lines.append(f"stage {s} " + "".join(f"{row[s]:<{width}}" for row in labels).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------- builders


def from_programs(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int,
    programs: Sequence[Sequence[Action]],
) -> Schedule:
    """Place each stage's ordered actions on the earliest ticks the dependencies allow.

    **Arguments:** `name`, sizes, and `programs[s]`: stage `s`'s actions in order.

    **Returns:** the `Schedule`. Raises `ValueError` if the programs deadlock.
    """
    p, v = num_stages, num_chunks
    G = p * v
    done: dict[tuple[str, int, int], int] = {}
    nxt = [0] * p
    rows: list[tuple[Action | None, ...]] = []
    total = sum(len(prog) for prog in programs)
    placed = 0
    while placed < total:
        t = len(rows)
        row: list[Action | None] = [None] * p
        for s in range(p):
            if nxt[s] == len(programs[s]):
                continue
            a = programs[s][nxt[s]]
            g = a.chunk * p + s
            if a.kind == "F":
                deps = [("F", a.microbatch, g - 1)] if g else []
            elif a.kind == "W":
                deps = [("B", a.microbatch, g)]
            else:
                deps = [("B", a.microbatch, g + 1) if g < G - 1 else ("F", a.microbatch, g)]
            if all(d in done and done[d] < t for d in deps):
                row[s] = a
        for s, a in enumerate(row):
            if a is not None:
                done[a.kind, a.microbatch, a.chunk * p + s] = t
                nxt[s] += 1
                placed += 1
        if all(a is None for a in row):
            raise ValueError(f"{name}: the stage programs deadlock at tick {t}.")
        rows.append(tuple(row))
    return Schedule(name, p, num_microbatches, v, tuple(rows))


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage runs all `m` forwards, then all `m` backwards."""
    _check_sizes(num_stages, num_microbatches, 1)
    m = num_microbatches
    prog = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return from_programs("gpipe", num_stages, m, 1, [prog] * num_stages)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): `p - s - 1` warm-up forwards, then one forward, one backward."""
    _check_sizes(num_stages, num_microbatches, 1)
    return from_programs("1f1b", num_stages, num_microbatches, 1, _one_f_one_b_programs(num_stages, num_microbatches))


def _one_f_one_b_programs(p: int, m: int) -> list[list[Action]]:
    """1F1B's program of each stage: `p - s - 1` warm-up forwards, then one forward, one backward."""
    programs = []
    for s in range(p):
        warm = min(p - s - 1, m)
        prog = [Action("F", i) for i in range(warm)]
        for i in range(m - warm):
            prog += [Action("F", warm + i), Action("B", i)]
        prog += [Action("B", i) for i in range(m - warm, m)]
        programs.append(prog)
    return programs


def interleaved(num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B with `v = num_chunks` chunks per stage (Megatron-LM's order).

    Forwards go through the chunks in groups of `p` microbatches (chunk 0 for
    microbatches 0..p-1, chunk 1 for the same, ..., then the next group);
    backwards run the chunks in reverse. Stage `s` warms up with
    `2 (p - s - 1) + (v - 1) p` forwards. Needs `m % p == 0` and `v >= 2`.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    _check_sizes(p, m, v)
    if v < 2:
        raise ValueError(f"interleaved needs num_chunks >= 2 (got {v}); with one chunk use '1f1b'.")
    if m % p:
        ok = [k * p for k in range(1, 5)]
        raise ValueError(
            f"interleaved needs microbatches divisible by the {p} stages (got m={m}); "
            f"use m in {ok}..., or the '1f1b' schedule."
        )
    total = m * v

    def action(kind: Literal["F", "B"], k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(kind, group * p + within % p, chunk if kind == "F" else v - 1 - chunk)

    programs = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        prog = [action("F", k) for k in range(warm)]
        for k in range(total - warm):
            prog += [action("F", warm + k), action("B", k)]
        prog += [action("B", k) for k in range(total - warm, total)]
        programs.append(prog)
    return from_programs("interleaved", p, m, v, programs)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into `B` (input gradient) and `W` (weight gradient).

    Stage `s` runs 1F1B's order of `F`s and `B`s and puts `W(k)` right after
    `B(k + s)`; the `W`s left over run at the end. The first stage runs each `W`
    at once, the last defers its `W`s the most: its `B`s reach the earlier stages
    sooner, and its deferred `W`s fill the drain. Every stage holds at most `p`
    stage inputs (as 1F1B's first stage); idle cells `p (p - 1)`, half of 1F1B's,
    in `3 m + p - 1` ticks. Needs `m >= p`.
    """
    p, m = num_stages, num_microbatches
    _check_sizes(p, m, 1)
    if m < p:
        raise ValueError(
            f"zb1 needs at least as many microbatches as pipeline stages (got m={m} for p={p}); "
            f"use --microbatches {p} or more (Pipeline(microbatches=...)), or the '1f1b' schedule."
        )
    programs = []
    for s, f_and_b in enumerate(_one_f_one_b_programs(p, m)):
        prog, w = [], 0
        for a in f_and_b:
            prog.append(a)
            if a.kind == "B" and a.microbatch >= s:
                prog.append(Action("W", w))
                w += 1
        programs.append(prog + [Action("W", i) for i in range(w, m)])
    return from_programs("zb1", p, m, 1, programs)


def _check_sizes(p: int, m: int, v: int) -> None:
    for what, n in (("num_stages", p), ("num_microbatches", m), ("num_chunks", v)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}.")


def make_pipeline_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """The schedule called `name` ("gpipe", "1f1b", "interleaved" or "zb1").

    **Arguments:** `name`; `num_stages` (p); `num_microbatches` (m); `num_chunks`
    (v, used by "interleaved" only).

    **Returns:** the `Schedule`.
    """
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    if name == "interleaved":
        return interleaved(num_stages, num_microbatches, num_chunks)
    if name == "zb1":
        return zero_bubble_h1(num_stages, num_microbatches)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}.")


def bubble_report(schedule: Schedule) -> str:
    """One line: measured bubble of the table, the analytic formula, and the peak stage inputs held."""
    return (f"{schedule.name}: p={schedule.num_stages} m={schedule.num_microbatches} v={schedule.num_chunks} "
            f"bubble {schedule.bubble:.3f} (idle {schedule.idle_ticks} of "
            f"{schedule.num_ticks * schedule.num_stages} stage-ticks; formula {schedule.expected_bubble:.3f}); "
            f"at most {schedule.peak_in_flight} stage inputs in flight")
