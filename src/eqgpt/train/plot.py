"""`loss.png`: train and validation loss of a whole run on one axis."""

from __future__ import annotations

from pathlib import Path

# The y axis is logarithmic once the loss spans this factor (early steps would flatten the rest).
LOG_Y_FROM = 2.0


def loss_title(history, title: str = "") -> str:
    """`title`, with the last validation loss in nats/token and bits/byte when measured."""
    _, vals = history.series("val_loss")
    _, bpb = history.series("val_bpb")
    last = [f"validation {vals[-1]:.3f} nats/token"] if vals else []
    last += [f"{bpb[-1]:.3f} bits/byte"] if bpb else []
    return "\n".join(p for p in (title, ", ".join(last)) if p)


def loss_figure(history, *, title: str = ""):
    """The matplotlib figure of `plot_history` (matplotlib must be importable)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    xs, ys = history.series("loss")
    if xs:
        ax.plot(xs, ys, "-", lw=1.2, label="train")
    vx, vy = history.series("val_loss")
    if vx:
        ax.plot(vx, vy, "o", ms=4, label="validation")
    values = [v for v in (*ys, *vy) if v > 0]
    if values and max(values) / min(values) >= LOG_Y_FROM:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 2, 3, 4 nats rather than 10^0.5
        ax.yaxis.set_major_formatter(plain)
        if max(values) / min(values) < 10:
            ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(loss_title(history, title), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if xs or vx:
        ax.legend()
    fig.tight_layout()
    return fig


def plot_history(history, path: str | Path, *, title: str = "") -> Path | None:
    """Train loss (a line) and validation loss (points) against step in nats/token, one axis and one
    legend, bits/byte in the title; `None` (and a notice) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss plot (pip install 'eqgpt[plot]').")
        return None
    fig = loss_figure(history, title=title)
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
