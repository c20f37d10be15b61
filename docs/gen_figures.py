"""Draw the course's pipeline and context-parallel pictures from the code's own tables.

    .venv/bin/python docs/gen_figures.py          # writes docs/img/*.png

Every picture is drawn from what the implementation computes, never by hand:

- pipeline schedules: the tick-by-stage table of `eqgpt.parallel.pipeline`'s
  schedule builders (`Schedule.ticks`, each cell an `Action` or idle), so a
  change to a schedule changes its picture;
- the context layout: `eqgpt.parallel.context.layout_positions` (which global
  positions each device holds, zigzag or contiguous), and the causal work each
  device does at each ring step (`block_counts`-style, computed here from the same
  positions).

`tests/test_docs.py` checks that the committed PNGs exist; rerun this script after
changing a schedule or the layout.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from eqgpt.parallel import pipeline as pp  # noqa: E402
from eqgpt.parallel.context import layout_positions  # noqa: E402

IMG = pathlib.Path(__file__).resolve().parent / "img"
F_COLOURS = plt.get_cmap("Blues")
B_COLOURS = plt.get_cmap("Oranges")
W_COLOURS = plt.get_cmap("Greens")  # a split backward's weight gradient (ZB-H1)


def schedule(name: str, stages: int, microbatches: int, chunks: int = 1):
    """The library's schedule table (the same builder the executor runs)."""
    build = pp.make_pipeline_schedule
    return build(name, stages, microbatches, chunks) if name == "interleaved" else build(name, stages, microbatches)


def draw_schedule(ax, sched) -> None:
    """One row per stage, one column per tick; F cells blue, B cells orange, W cells green, idle cells blank."""
    p, m, v = sched.num_stages, sched.num_microbatches, sched.num_chunks
    for t, row in enumerate(sched.ticks):
        for s, action in enumerate(row):
            if action is None:
                ax.add_patch(Rectangle((t, s), 1, 1, facecolor="#f2f2f2", edgecolor="white"))
                continue
            shade = 0.35 + 0.5 * (action.microbatch + action.chunk * m) / max(1, m * v - 1)
            colour = {"F": F_COLOURS, "B": B_COLOURS, "W": W_COLOURS}[action.kind](shade)
            ax.add_patch(Rectangle((t, s), 1, 1, facecolor=colour, edgecolor="white"))
            ax.text(t + 0.5, s + 0.5, action.label(v), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, sched.num_ticks)
    ax.set_ylim(p, 0)
    ax.set_yticks(np.arange(p) + 0.5, [f"stage {s}" for s in range(p)])
    ax.set_xticks([])
    ax.set_title(f"{sched.name}: p={p} m={m}" + (f" v={v}" if v > 1 else "")
                 + f" - {sched.num_ticks} ticks, bubble {sched.bubble:.2f} (formula {sched.expected_bubble:.2f})",
                 fontsize=9, loc="left")
    for spine in ax.spines.values():
        spine.set_visible(False)


def pipeline_figure(path: pathlib.Path) -> None:
    scheds = [schedule("gpipe", 4, 8), schedule("1f1b", 4, 8), schedule("interleaved", 4, 8, 2), schedule("zb1", 4, 8)]
    width = max(s.num_ticks for s in scheds)
    fig, axes = plt.subplots(len(scheds), 1, figsize=(0.28 * width + 1.5, 1.3 * len(scheds) + 0.4))
    for ax, s in zip(axes, scheds, strict=True):
        draw_schedule(ax, s)
        ax.set_xlim(0, width)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def causal_blocks(seq_len: int, size: int, ordering: str) -> np.ndarray:
    """`[ring step, device]`: query-key pairs device d attends to at ring step r (it holds the keys of
    device (d - r) mod size then), counted from `layout_positions`."""
    pos = layout_positions(seq_len, size, ordering).reshape(size, -1)
    work = np.zeros((size, size), int)
    for r in range(size):
        for d in range(size):
            q, k = pos[d][:, None], pos[(d - r) % size][None, :]
            work[r, d] = int((k <= q).sum())
    return work


def context_figure(path: pathlib.Path, seq_len: int = 16, size: int = 4) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), layout="constrained", gridspec_kw={"height_ratios": [0.5, 1.6]})
    cmap = plt.get_cmap("tab10")
    for col, ordering in enumerate(("contiguous", "zigzag")):
        pos = layout_positions(seq_len, size, ordering).reshape(size, -1)
        ax = axes[0, col]
        for d in range(size):
            for p in pos[d]:
                ax.add_patch(Rectangle((p, 0), 1, 1, facecolor=cmap(d), edgecolor="white"))
                ax.text(p + 0.5, 0.5, str(d), ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(0, seq_len)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(np.arange(seq_len) + 0.5, [str(i) for i in range(seq_len)], fontsize=7)
        ax.set_title(f"{ordering}: which device holds each position", fontsize=9, loc="left")
        work = causal_blocks(seq_len, size, ordering)
        ax = axes[1, col]
        im = ax.imshow(work, cmap="Greens", vmin=0, vmax=(seq_len // size) ** 2)
        for r in range(size):
            for d in range(size):
                ax.text(d, r, str(work[r, d]), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(size), [f"dev {d}" for d in range(size)], fontsize=8)
        ax.set_yticks(range(size), [f"ring step {r}" for r in range(size)], fontsize=8)
        totals = work.sum(0)
        ax.set_title(f"{ordering}: causal (q, k) pairs per ring step\nper-device totals {totals.tolist()}", fontsize=9, loc="left")
    fig.colorbar(im, ax=axes[1, :].tolist(), shrink=0.8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> list[pathlib.Path]:
    IMG.mkdir(exist_ok=True)
    out = [IMG / "pipeline_schedules.png", IMG / "context_layout.png"]
    pipeline_figure(out[0])
    context_figure(out[1])
    for p in out:
        print(f"wrote {p}")
    return out


if __name__ == "__main__":
    main()
