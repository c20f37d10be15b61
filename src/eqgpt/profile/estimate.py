"""Per-device memory of a training step, predicted before anything compiles.

`estimate(config, mesh, strategy, batch, seq, policy, remat)` answers "will it
fit?" from shapes alone: it builds the model with `jax.eval_shape` (no arrays),
asks the strategy's rule set how each weight is split, and counts bytes.

How each part is counted:

- `params`: every weight's per-device shard (`param_specs` of the strategy's rules), in
  `policy.param_dtype`.
- `opt_state`: AdamW's two moments per parameter, fp32, laid out like the parameters or,
  under ZeRO, split over `data` as well; plus fp32 master weights when the policy keeps them.
- `batch`: the step's token and target rows on one device (int32).
- `grads`: the gradient buffers the step holds before it reduces and applies them.
- `activations`: what the backward pass keeps per layer (saved residuals) for the tokens one
  device holds at once, plus one layer's and the loss's working set.

`params + opt_state + batch` is exact (it follows from the shardings alone) and is
compared with the compiled step's `argument_bytes`. `grads + activations` is a
model of the compiler's `temp_bytes`: the per-token coefficients below count the
tensors a GPT block saves for its backward pass (residual width `D`, MLP width
`F`, attention scores `H x T`) and were checked against XLA's buffer assignment of
eqgpt's step on the CPU backend (see `docs/course/13-memory.md`, which prints the
comparison, and `tests/test_estimate.py`, which holds it within 25%). On GPU/TPU
the same tensors are saved, but fusion, bf16 compute and asynchronous
collectives change the working set; treat temporaries as an estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eqgpt.config import GPTConfig

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

# Floats saved per token per layer for the backward pass (fp32 compute, remat="none"):
# residual-width tensors (norm inputs/outputs, q/k/v, attention output, residuals),
# MLP-width tensors (up projection, activation), and attention scores/probabilities.
SAVED_D, SAVED_F, SAVED_S = 14, 2, 2
# One layer's working set in the backward pass (recomputed or not), per token.
WORK_D, WORK_F, WORK_S = 6, 2, 3
# The loss: one chunk of logits, their softmax and gradient, per token of the chunk.
WORK_V = 3
# remat="full" keeps only each block's input; "dots" keeps the matmul outputs too.
REMAT_SAVED = {"none": (SAVED_D, SAVED_F, SAVED_S), "full": (1, 0, 0), "dots": (8, 2, 0)}
# How much of the counted (saved, working) activation bytes XLA's buffer assignment keeps
# live at its peak, per family of layouts (see `estimate`), and the gradient buffers:
# fitted to eqgpt's compiled step on the CPU backend (jax 0.10, checked on 0.12) over 4 model
# sizes per family; `tests/test_estimate.py` holds six strategies within 25%, and
# docs/course/13-memory.md lists where the model is weaker (the pipeline's working set).
CALIBRATION = {"single": (0.99, 0.81), "replicated": (0.72, 0.23), "sharded": (0.86, 1.01)}
ZERO_GRADS = 1.09  # x local parameter bytes: the whole gradient plus the gathered update
FSDP_GRADS = 0.22  # x parameter bytes unsharded by fsdp: whole gradients live before the reduce-scatter


@dataclass(frozen=True)
class Estimate:
    """Predicted bytes per device of one training step (see the module docs for each part)."""

    params: int
    opt_state: int
    batch: int
    grads: int
    activations: int
    strategy: str = ""

    @property
    def arguments(self) -> int:
        """What the step takes in: parameters, optimizer state and batch (compare `argument_bytes`)."""
        return self.params + self.opt_state + self.batch

    @property
    def temporaries(self) -> int:
        """What the step allocates while it runs: gradients and activations (compare `temp_bytes`)."""
        return self.grads + self.activations

    @property
    def total(self) -> int:
        """Arguments, their updated copies (outputs), and temporaries: the step's peak without donation."""
        return 2 * (self.params + self.opt_state) + self.batch + self.temporaries

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.params), ("optimizer state", self.opt_state), ("batch", self.batch),
                ("gradients", self.grads), ("activations", self.activations),
                ("arguments (params + opt + batch)", self.arguments), ("temporaries (grads + act.)", self.temporaries)]

    def table(self, compiled: Any = None, *, title: str = "") -> str:
        """A printable table of the estimate; with `compiled`, next to its `memory_analysis`."""
        from rich.table import Table

        from eqgpt.profile.memory import MemoryReport, memory
        from eqgpt.profile.text import table_text

        mem = None if compiled is None else compiled if isinstance(compiled, MemoryReport) else memory(compiled)
        measured = {} if mem is None else {"arguments (params + opt + batch)": mem.argument_bytes,
                                           "temporaries (grads + act.)": mem.temp_bytes}
        table = Table(title=title or f"{self.strategy}: estimated memory per device")
        for col in ("what", "estimate MiB") + (("compiled MiB", "ratio") if mem else ()):
            table.add_column(col, justify="left" if col == "what" else "right")
        for name, value in self.rows():
            row = [name, f"{value / 2**20:.3f}"]
            if mem is not None:
                got = measured.get(name)
                row += ["" if got is None else f"{got / 2**20:.3f}", "" if not got else f"{value / got:.2f}"]
            table.add_row(*row)
        return table_text(table, width=100)


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _local_size(shape: tuple[int, ...], spec: Any, mesh: Any) -> int:
    """Elements of one device's shard of an array of `shape` laid out by `spec`."""
    entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
    sizes = [math.ceil(d / math.prod(mesh.shape[a] for a in _axes(e))) for d, e in zip(shape, entries, strict=True)]
    return math.prod(sizes)


def _bytes_of(dtype: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]


def _local_sizes(model_like: Any, strategy: Any) -> tuple[list[int], list[int], dict[str, int]]:
    """Elements per device of each parameter and of its optimizer state, and the mesh's axis sizes."""
    import jax

    from eqgpt.parallel import Zero
    from eqgpt.parallel.zero import zero_specs

    mesh = strategy.mesh
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    leaves = jax.tree.leaves(model_like, is_leaf=is_leaf)
    if mesh is None:
        local = [int(np.prod(x.shape)) for x in leaves]
        opt_local = local
        shape = dict(data=1, fsdp=1, pipeline=1, context=1, tensor=1)
    else:
        from eqgpt.parallel.auto import param_specs
        from eqgpt.parallel.rules import is_spec

        shape = dict(mesh.shape)
        specs = jax.tree.leaves(param_specs(model_like, strategy.param_rules, strategy.overrides, mesh=mesh),
                                is_leaf=is_spec)
        local = [_local_size(tuple(x.shape), s, mesh) for x, s in zip(leaves, specs, strict=True)]
        opt_local = local
        if strategy.part(Zero) is not None:
            zspecs = jax.tree.leaves(zero_specs(model_like, mesh, strategy.param_rules, strategy.overrides),
                                     is_leaf=is_spec)
            opt_local = [_local_size(tuple(x.shape), s, mesh) for x, s in zip(leaves, zspecs, strict=True)]
    return local, opt_local, shape


def _gradient_family(strategy: Any, shape: dict[str, int], tp: int, n_params: int) -> tuple[str, float]:
    """Which `CALIBRATION` family the step falls in, and its gradient buffer bytes (see `estimate`)."""
    from eqgpt.parallel import Zero

    mesh = strategy.mesh
    fsdp = shape.get("fsdp", 1) if "fsdp" in strategy.param_rules.axes("embed", "params") else 1
    if mesh is None:
        family, grads = "single", 0.0
    elif fsdp > 1 or tp > 1:
        family, grads = "sharded", FSDP_GRADS * 4 * n_params * fsdp if fsdp > 1 else 0.0
    else:
        family, grads = "replicated", ZERO_GRADS * 4 * n_params if strategy.part(Zero) else 0.0
    return family, grads


def estimate(
    config: GPTConfig,
    mesh: Any = None,
    strategy: Strategy | str = "dp",
    batch: int = 8,
    seq: int | None = None,
    policy: Any = None,
    remat: str | None = None,
    scores: bool = True,
) -> Estimate:
    """Bytes per device of one training step with AdamW, from shapes alone (nothing compiles).

    **Arguments:**

    - `config`: the model's `GPTConfig`.
    - `mesh`: a mesh from `make_mesh` (or `None` for one device); ignored when
      `strategy` is a `Strategy`, which carries its own.
    - `strategy`: an `eqgpt.parallel.Strategy`, or a rule-set name (`"dp"`, `"fsdp+tp"`, ...)
      for `Strategy(mesh, strategy)`.
    - `batch`: global rows per step; `seq`: tokens per row (default `config.seq_len`).
    - `policy`: an `eqgpt.train.Policy` (default fp32 everywhere).
    - `remat`: `"none" | "full" | "dots"` (default `config.remat`; other policies
      count as `"dots"`).
    - `scores`: whether attention materialises `[T, T]` scores (the reference kernel);
      `False` for kernels that work in blocks (blockwise, flash, splash): no `H x T` term.

    **Returns:** an `Estimate` (`params`, `opt_state`, `batch`, `grads`,
    `activations`; `arguments`, `temporaries`; `.table(compiled)` to print it next
    to a compiled step's memory analysis).
    """
    import equinox as eqx
    import jax

    from eqgpt.nn import GPT
    from eqgpt.parallel import Pipeline, Strategy

    if not isinstance(strategy, Strategy):
        strategy = Strategy(mesh, strategy) if mesh is not None else Strategy()
    mesh = strategy.mesh
    seq = seq or config.seq_len
    remat = remat or config.remat
    param_bytes = _bytes_of(getattr(policy, "param_dtype", "fp32"))
    act_bytes = _bytes_of(getattr(policy, "compute_dtype", "fp32"))
    master = bool(getattr(policy, "master_weights", False))
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    model_like = eqx.filter(jax.eval_shape(lambda: GPT(config, key=jax.random.key(0))), is_leaf)
    local, opt_local, shape = _local_sizes(model_like, strategy)
    n_params = sum(local)
    params = n_params * param_bytes
    opt_state = (2 + master) * 4 * sum(opt_local)

    # ---- tokens one device holds at once
    pipeline = strategy.part(Pipeline)
    tp = shape.get("tensor", 1)
    ctx = shape.get("context", 1)
    rows = batch / strategy.batch_divisor
    layers = config.num_layers
    in_flight = 1.0
    if pipeline is not None:
        p, m = shape.get("pipeline", 1), pipeline.microbatches
        layers = config.num_layers / p
        rows = rows / m
        in_flight = min(p, m)  # 1F1B: at most p microbatches between forward and backward on stage 0
    tokens = rows * seq / ctx
    batch_bytes = int(2 * 4 * rows * (m if pipeline is not None else 1) * seq)

    d, f, h, v = config.embed_dim, config.hidden_dim / tp, config.num_heads / tp, config.padded_vocab_size / tp
    sp = strategy.sequence_parallel if mesh is not None else False
    d_saved = d / tp if sp else d
    sd, sf, ss = REMAT_SAVED.get(remat, REMAT_SAVED["dots"])
    work_s = WORK_S if scores else 0
    ss = ss if scores else 0
    per_layer = sd * d_saved + sf * f + ss * h * seq
    saved = layers * in_flight * tokens * per_layer
    working = tokens * (WORK_D * d + WORK_F * f + work_s * h * seq) + rows * min(128, seq) / ctx * WORK_V * v
    if pipeline is not None:
        # The executor keeps only each in-flight microbatch's stage input and recomputes the
        # chunk inside its backward branch: there one microbatch's chunk residuals and their
        # cotangents are live together, working set rather than saved.
        saved = layers * in_flight * tokens * d
        working += 2 * layers * tokens * per_layer

    # ---- gradient buffers, and the compiler's reuse of activation buffers, by family:
    # one device (the update fuses into the backward pass); weights replicated on a mesh
    # (DP, ZeRO, pipeline: the gradient all-reduce runs in place; ZeRO also holds the whole
    # gradient and the gathered parameters); weights sharded (FSDP, TP: each device
    # computes whole-weight gradients before they are reduce-scattered).
    family, grads = _gradient_family(strategy, shape, tp, n_params)
    c_saved, c_work = CALIBRATION[family]
    activations = int(act_bytes * (c_saved * saved + c_work * working))

    return Estimate(params, opt_state, batch_bytes, int(grads), activations, strategy=strategy.describe())


__all__ = ["Estimate", "estimate"]
