"""Traces of chosen training steps, device-memory profiles, and where a step's time goes.

- `trace(log_dir)`: a `jax.profiler` trace of the block: `*.xplane.pb` (TensorBoard /
  XProf) and, by default, `*.trace.json.gz` (open in https://ui.perfetto.dev).
- `ProfileWindow(start, stop, log_dir)`: the same for steps `start..stop-1` of a loop
  (what `TrainerConfig.profile_steps` uses), with one `StepTraceAnnotation` per
  step and a device-memory profile (`memory.prof`, pprof format) after the last.
- `step_breakdown(log_dir)`: per traced step, the time each device spent in compute,
  in each kind of collective, idle between ops, and on the host (dispatch); and
  `breakdown_table` / `op_table` to print them.

Step time here is the wall time of the step's annotation; inside the window each
step is waited for, so the annotation spans the step's device work. The table
splits that time into rows that add up to it (see `StepBreakdown`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import jax

from eqgpt.profile.collectives import KINDS

STEP_NAME = "train"


def profiler_options(*, python: bool = False) -> jax.profiler.ProfileOptions:
    """Profiler options: host and XLA ops traced; Python function calls only if `python`.

    The Python tracer records every Python call (tens of thousands per compiled
    step on CPU) and makes traces slow to take and to open; it is off by default.
    """
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    return options


@contextlib.contextmanager
def trace(log_dir: str | Path, *, perfetto: bool = True, python: bool = False) -> Iterator[Path]:
    """Trace everything run inside the block into `log_dir`.

    **Arguments:** `log_dir` (created); `perfetto`: also write a Perfetto
    `*.trace.json.gz`; `python`: also trace Python calls.

    **Yields:** `log_dir` as a `Path`. The files land in
    `log_dir/plugins/profile/<timestamp>/` (see `trace_files`). Wait for the work
    you trace (`jax.block_until_ready`) before the block ends.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=perfetto,
                            profiler_options=profiler_options(python=python)):
        yield log_dir


def step_annotation(step: int, name: str = STEP_NAME) -> jax.profiler.StepTraceAnnotation:
    """The annotation that marks one training step in a trace (`name`, `step_num=step`)."""
    return jax.profiler.StepTraceAnnotation(name, step_num=step)


def save_memory_profile(path: str | Path) -> Path:
    """Write the live device buffers as a pprof profile (`go tool pprof -http=: path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    jax.profiler.save_device_memory_profile(str(path))
    return path


class ProfileWindow:
    """Trace steps `start..stop-1` of a training loop.

    Call `begin(step)` before dispatching a step: it starts the trace at `start`
    and returns the step's annotation (a context manager; a no-op outside the
    window). Call `end(step, outputs)` after it: inside the window it waits for
    `outputs`, and after the last step it saves a device-memory profile
    (`log_dir/memory.prof`: the live buffers, i.e. model, optimizer state and what
    the step keeps) and stops the trace. `close()` stops a trace left open (a loop
    that ended early).

    **Arguments:** `start`, `stop` (`0 <= start < stop`); `log_dir`; `memory`:
    also write the memory profile; `perfetto`, `python`: as `trace`.
    """

    def __init__(self, start: int, stop: int, log_dir: str | Path, *, memory: bool = True,
                 perfetto: bool = True, python: bool = False):
        if not 0 <= start < stop:
            raise ValueError(f"profile steps must satisfy 0 <= start < stop, got {start}:{stop} "
                             "(e.g. 10:15 traces steps 10 to 14).")
        self.start, self.stop, self.log_dir = start, stop, Path(log_dir)
        self.memory, self.perfetto, self.python = memory, perfetto, python
        self.active = False
        self.taken = False  # a trace was started (the loop reached `start`)
        self.memory_profile: Path | None = None

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.stop

    def begin(self, step: int):
        """Start the trace at `start`; **returns** this step's annotation (or a null context)."""
        if step == self.start and not self.active:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=self.perfetto,
                                     profiler_options=profiler_options(python=self.python))
            self.active = self.taken = True
        return step_annotation(step) if self.active and step in self else contextlib.nullcontext()

    def run(self, step: int, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` as step `step`: annotated and waited for inside the window.

        Outside the window this is just the call (no wait: dispatch stays asynchronous).
        """
        with self.begin(step):
            out = fn(*args, **kwargs)
            if self.active:
                jax.block_until_ready(out)
        self.end(step)
        return out

    def end(self, step: int, outputs=None) -> None:
        """Wait for `outputs`; after step `stop - 1` write the memory profile and stop the trace.

        With `begin`/`end` by hand, wait for the step's outputs inside the
        annotation yourself, or the annotation covers only the dispatch (`run` does both).
        """
        if not self.active:
            return
        jax.block_until_ready(outputs)
        if step + 1 >= self.stop:
            if self.memory:
                self.memory_profile = save_memory_profile(self.log_dir / "memory.prof")
            self.close()

    def close(self) -> None:
        """Stop the trace if it is running."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """`"10:15"` -> `(10, 15)` (steps 10 to 14); `None` or `""` -> `None`."""
    if not text:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise ValueError(f"profile steps must read START:STOP with START < STOP (e.g. 10:15), got {text!r}.")
    return int(m.group(1)), int(m.group(2))


def trace_files(log_dir: str | Path) -> dict[str, Path]:
    """The newest trace under `log_dir`: `{"xplane": ..., "perfetto": ...}` (those that exist).

    Raises `FileNotFoundError` if `log_dir` holds no trace.
    """
    runs = sorted(Path(log_dir).glob("plugins/profile/*/"))
    if not runs:
        raise FileNotFoundError(f"no trace under {log_dir} (expected plugins/profile/<run>/*.xplane.pb).")
    out = {}
    for key, pattern in (("xplane", "*.xplane.pb"), ("perfetto", "*.trace.json.gz")):
        found = sorted(runs[-1].glob(pattern))
        if found:
            out[key] = found[0]
    return out


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One XLA op execution on one device: HLO instruction `name` of program `module`."""

    name: str
    module: str
    device: int
    start_ns: float
    end_ns: float


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """One step annotation: step number and wall interval."""

    step: int
    start_ns: float
    end_ns: float


def _xplane(path: str | Path) -> Path:
    path = Path(path)
    return trace_files(path)["xplane"] if path.is_dir() else path


def _tpu_ordinal(plane_name: str) -> int:
    return int(plane_name.rsplit(":", 1)[-1]) if plane_name.rsplit(":", 1)[-1].isdigit() else 0


def load_events(path: str | Path, step_name: str = STEP_NAME) -> tuple[list[OpEvent], list[StepEvent]]:
    """XLA op events (with their device) and step annotations of a trace.

    **Arguments:** `path`, a log directory (its newest trace) or an `*.xplane.pb`;
    `step_name`, the name of the step annotations.
    """
    data = jax.profiler.ProfileData.from_file(str(_xplane(path)))
    ops, steps = [], []
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name == step_name or (line.name == "python" and e.name.startswith(step_name)):
                    stats = dict(e.stats)
                    if "step_num" in stats:
                        steps.append(StepEvent(int(stats["step_num"]), e.start_ns, e.end_ns))
                    continue
                if line.name == "XLA Ops" and plane.name.startswith("/device:TPU"):
                    # A TPU names each op by its HLO text (`%fusion.3 = ...`); async ops repeat on their own line.
                    name = re.match(r"%?([\w.\-]+)", e.name)
                    ops.append(OpEvent(name.group(1) if name else e.name, "", _tpu_ordinal(plane.name),
                                       e.start_ns, e.end_ns))
                    continue
                stats = dict(e.stats)
                if "hlo_op" in stats and not plane.name.startswith("/device:TPU"):
                    ops.append(OpEvent(str(stats["hlo_op"]), str(stats.get("hlo_module", "")),
                                       int(stats.get("device_ordinal", 0)), e.start_ns, e.end_ns))
    return ops, sorted(steps, key=lambda s: s.start_ns)


def collective_kind(op_name: str) -> str | None:
    """The collective kind of an HLO instruction name (`all-gather.3` -> `all-gather`), or `None`."""
    base = re.sub(r"\.\d+$", "", op_name)
    for kind in sorted(KINDS, key=len, reverse=True):
        if base == kind or base.startswith(kind + "-") or base.startswith(kind + "."):
            return kind
    return None


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Where one step's wall time went, per device on average (nanoseconds).

    `rows` partition `step_ns`: `compute` (some op but no collective in flight),
    one row per collective kind (a collective in flight, overlapped or not),
    `idle` (between the device's first and last op, nothing in flight) and `host`
    (the rest of the step: dispatch, transfers, Python). `device_ns` is the
    device span, `step_ns - rows["host"]`.
    """

    step: int
    step_ns: float
    device_ns: float
    rows: dict[str, float]
    devices: int

    @property
    def communication_ns(self) -> float:
        return sum(v for k, v in self.rows.items() if k in KINDS)


def _partition(ops: list[OpEvent]) -> dict[str, float]:
    """Sweep the intervals of one device: time by what is in flight (collectives first)."""
    points = []
    for op in ops:
        kind = collective_kind(op.name) or "compute"
        points.append((op.start_ns, 1, kind))
        points.append((op.end_ns, -1, kind))
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = defaultdict(int)
    out: dict[str, float] = defaultdict(float)
    last = None
    for t, delta, kind in points:
        if last is not None and t > last:
            live = [k for k in KINDS if active[k] > 0]
            label = live[0] if live else ("compute" if active["compute"] > 0 else "idle")
            out[label] += t - last
        active[kind] += delta
        last = t
    return out


def step_breakdown(path: str | Path, *, module: str | None = None, step_name: str = STEP_NAME) -> list[StepBreakdown]:
    """Compute, communication (by kind), idle and host time of every annotated step of a trace.

    **Arguments:** `path` (log directory or `*.xplane.pb`); `module`: count only
    ops of this XLA program (e.g. `"jit_step"`), default all; `step_name`: the
    step annotations' name.

    **Returns:** one `StepBreakdown` per step annotation, averaged over the
    devices that ran ops in it.
    """
    ops, steps = load_events(path, step_name)
    if not steps:
        raise ValueError(f"the trace has no {step_name!r} step annotations; take it with ProfileWindow or "
                         "wrap each step in eqgpt.profile.trace.step_annotation(step).")
    out = []
    for s in steps:
        per_device: dict[int, list[OpEvent]] = defaultdict(list)
        for op in ops:
            if op.start_ns >= s.start_ns and op.end_ns <= s.end_ns and (module is None or op.module == module):
                per_device[op.device].append(op)
        step_ns = s.end_ns - s.start_ns
        rows: dict[str, float] = defaultdict(float)
        span = 0.0
        for dev_ops in per_device.values():
            for k, v in _partition(dev_ops).items():
                rows[k] += v / len(per_device)
            span += (max(o.end_ns for o in dev_ops) - min(o.start_ns for o in dev_ops)) / len(per_device)
        ordered = {k: rows.get(k, 0.0) for k in ("compute", *KINDS, "idle")}
        ordered["host"] = max(step_ns - span, 0.0)
        out.append(StepBreakdown(s.step, step_ns, span, ordered, len(per_device)))
    return out


def breakdown_table(path: str | Path, *, module: str | None = None, title: str = "step time by kind") -> str:
    """`step_breakdown` as a text table: ms per step and share of the step, rows then totals."""
    from rich.table import Table

    from eqgpt.profile.text import table_text

    steps = step_breakdown(path, module=module)
    n = len(steps)
    step_ms = sum(s.step_ns for s in steps) / n / 1e6
    devices = max(s.devices for s in steps)
    table = Table(title=f"{title} (mean of {n} step{'s' * (n > 1)}, {devices} device{'s' * (devices > 1)})")
    for col in ("", "ms / step", "share"):
        table.add_column(col, justify="left" if not col else "right")
    for key in steps[0].rows:
        ms = sum(s.rows[key] for s in steps) / n / 1e6
        if ms > 0 or key in ("compute", "idle", "host"):
            label = key if key in ("compute", "idle", "host") else f"comm: {key}"
            table.add_row(label, f"{ms:.2f}", f"{ms / step_ms:.1%}")
    comm = sum(s.communication_ns for s in steps) / n / 1e6
    table.add_row("communication (all kinds)", f"{comm:.2f}", f"{comm / step_ms:.1%}")
    table.add_row("step (annotation)", f"{step_ms:.2f}", "100.0%")
    return table_text(table)


def _hlo_text(program) -> str:
    """HLO text of a string, a `jax.stages.Compiled` or an equinox `filter_jit(...).lower(...).compile()`."""
    if isinstance(program, str):
        return program
    program = getattr(program, "compiled", program)
    return program.as_text()


_OP_NAME = re.compile(r'%?([\w.\-]+) = [^\n]*?op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the JAX scope path), from `compiled.as_text()`."""
    return {m.group(1): m.group(2) for m in _OP_NAME.finditer(hlo_text)}


def scope_of(op_name: str, scopes: tuple[str, ...]) -> str:
    """The innermost of `scopes` named in an `op_name` path (`.../block/attention/...`), or `"other"`."""
    parts = op_name.split("/")
    for part in reversed(parts):
        base = part.split("(")[-1].rstrip(")")
        if base in scopes:
            return base
    return "other"


def op_table(path: str | Path, *, hlo_text=None, scopes: tuple[str, ...] | None = None,
             top: int = 15, module: str | None = None) -> str:  # noqa: D417
    """The ops (or, with `scopes`, the named scopes) that took the most device time per step.

    **Arguments:** `path` (log directory or `*.xplane.pb`); `hlo_text`: the traced
    program (its `compiled.as_text()`, or the compiled object), to show each op's JAX name; `scopes`: group by
    these `jax.named_scope` names instead (needs `hlo_text`); `top` rows; `module`.

    Times add every thread's op time (ops running concurrently both count) and
    are divided by the number of step annotations (at least 1).
    """
    from rich.table import Table

    from eqgpt.profile.text import table_text

    ops, steps = load_events(path)
    n = max(len(steps), 1)
    names = op_names(_hlo_text(hlo_text)) if hlo_text is not None else {}
    # A container op (a while loop, a call) encloses its body's ops: count leaves only.
    leaves = [o for o in ops if not re.match(r"(while|call|conditional)(\.\d+)?$", o.name)
              and (module is None or o.module == module)]
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for o in leaves:
        key = scope_of(names.get(o.name, ""), scopes) if scopes else o.name
        total[key] += o.end_ns - o.start_ns
        count[key] += 1
    grand = sum(total.values()) or 1.0
    table = Table(title=f"device time by {'scope' if scopes else 'op'} (per step, all threads)")
    for col in (("scope" if scopes else "op", "ms", "share", "calls (all devices)")
                + (() if scopes or not names else ("JAX name",))):
        table.add_column(col, justify="left" if col in ("op", "scope", "JAX name") else "right")
    for key, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        row = [key, f"{ns / n / 1e6:.2f}", f"{ns / grand:.1%}", f"{count[key] / n:g}"]
        if names and not scopes:
            row.append(names.get(key, "")[-60:])
        table.add_row(*row)
    return table_text(table, width=140)




# Categories of one step's device time (`category_of`): named scopes first, then the op kind.
CATEGORIES = ("attention kernel", "other matmuls", "LM head and loss", "optimizer update", "everything else")
_SCOPE_CATEGORY = {"softmax_attention": "attention kernel", "loss": "LM head and loss",
                   "optimizer": "optimizer update"}


def fused_op_names(hlo_text: str) -> dict[str, list[str]]:
    """HLO instruction name -> the JAX names of what it computes: its own `op_name`, and for a
    fusion (whose metadata may be empty, as on TPU) those of the instructions it calls."""
    own: dict[str, list[str]] = defaultdict(list)
    calls: dict[str, list[str]] = {}
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = ", line)
        if not m:
            continue
        name = m.group(1)
        label = re.search(r'op_name="([^"]*)"', line)
        kind = re.search(r" (dot|convolution|custom-call)\(", line)
        text = (label.group(1) if label else "") + ("/dot_general" if kind and kind.group(1) != "custom-call" else "")
        if text and computation is not None:
            own[computation].append(text)
        called = re.findall(r"calls=%?([\w.\-]+)", line)
        calls[name] = ([text] if text else []) + [c for c in called]
    return {name: [t for item in items for t in (own.get(item, []) or [item])] if items else [""]
            for name, items in calls.items()}


def category_of(op_name: str) -> str:
    """The `CATEGORIES` entry of an op by its JAX name: the scopes `softmax_attention` (the kernel
    inside `eqgpt.nn.Attention`), `loss` and `optimizer` first, then any other matmul."""
    scope = scope_of(op_name, tuple(_SCOPE_CATEGORY))
    if scope in _SCOPE_CATEGORY:
        return _SCOPE_CATEGORY[scope]
    last = op_name.rsplit("/", 1)[-1]
    return "other matmuls" if re.match(r"(dot_general|dot|einsum|matmul|conv)", last) else "everything else"


def category_table(path: str | Path, *, hlo_text, module: str | None = None,
                   title: str = "one step's device time by category") -> str:
    """Device time per step by `CATEGORIES` (leaf ops only, divided by the step annotations).

    **Arguments:** `path` (log directory or `*.xplane.pb`); `hlo_text`: the traced
    program (its text or compiled object), whose `op_name`s give each op's JAX name;
    `module`: count only this XLA program's ops.
    """
    from rich.table import Table

    from eqgpt.profile.text import table_text

    ops, steps = load_events(path)
    n = max(len(steps), 1)
    names = fused_op_names(_hlo_text(hlo_text))
    total: dict[str, float] = {c: 0.0 for c in CATEGORIES}
    for o in ops:
        if re.match(r"(while|call|conditional)(\.\d+)?$", o.name) or (module is not None and o.module != module):
            continue
        kinds = [category_of(name) for name in names.get(o.name, [""])]
        if o.name.startswith(("splash", "flash")):  # a TPU names a Pallas call after its kernel, with no JAX name
            kinds.append("attention kernel")
        total[min(kinds, key=CATEGORIES.index)] += o.end_ns - o.start_ns
    grand = sum(total.values()) or 1.0
    table = Table(title=f"{title} (mean of {n} step{'s' * (n > 1)})")
    for col in ("category", "ms / step", "share"):
        table.add_column(col, justify="left" if col == "category" else "right")
    for key, ns in total.items():
        table.add_row(key, f"{ns / n / 1e6:.2f}", f"{ns / grand:.1%}")
    table.add_row("all device ops", f"{grand / n / 1e6:.2f}", "100.0%")
    return table_text(table, width=100)


def plot_timeline(path: str | Path, out: str | Path, *, step: int | None = None, title: str = "") -> Path | None:
    """Draw one traced step as a per-device timeline (PNG): compute and each collective kind in colour.

    **Arguments:** `path` (log directory or `*.xplane.pb`); `out`, the PNG to write;
    `step`: which annotated step (default the last); `title`.

    **Returns:** `out`, or `None` (with a notice) without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timeline (pip install 'eqgpt[plot]').")
        return None
    ops, steps = load_events(path)
    if not steps:
        raise ValueError("the trace has no step annotations (see ProfileWindow).")
    s = steps[-1] if step is None else next(x for x in steps if x.step == step)
    inside = [o for o in ops if o.start_ns >= s.start_ns and o.end_ns <= s.end_ns
              and not re.match(r"(while|call|conditional)(\.\d+)?$", o.name)]
    colours = {"compute": "#4c72b0", "all-reduce": "#dd5555", "all-gather": "#f0a030",
               "reduce-scatter": "#9b59b6", "all-to-all": "#2ca02c", "collective-permute": "#17becf"}
    devices = sorted({o.device for o in inside})
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(devices) + 1.6), dpi=110)
    for row, dev in enumerate(devices):
        for kind in colours:
            spans = [((o.start_ns - s.start_ns) / 1e6, (o.end_ns - o.start_ns) / 1e6) for o in inside
                     if o.device == dev and (collective_kind(o.name) or "compute") == kind]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colours[kind], linewidth=0)
    used = {collective_kind(o.name) or "compute" for o in inside}
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colours.items() if k in used]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), frameon=False)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlim(0, (s.end_ns - s.start_ns) / 1e6)
    ax.set_xlabel(f"ms since the start of step {s.step}")
    ax.set_title(title or f"step {s.step}: XLA ops per device")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


__all__ = [
    "CATEGORIES", "STEP_NAME", "OpEvent", "ProfileWindow", "StepBreakdown", "StepEvent", "breakdown_table",
    "category_of", "category_table", "collective_kind",
    "load_events", "op_names", "op_table", "parse_steps", "plot_timeline", "profiler_options", "save_memory_profile",
    "scope_of",
    "step_annotation", "step_breakdown", "trace", "trace_files",
]
