"""`Strategy`: one object that describes a parallelism completely.

A strategy is data: a mesh, a rule set (`"dp"`, `"fsdp+tp"`, ...), and optionally
a pipeline schedule, a context-attention kernel, or the manual (`shard_map`) path.
It gives the trainer everything it needs and nothing else:

- a `Placement` (the strategy *is* one): where the model, the optimizer state and
  each batch live;
- `grad_fn(policy)`: `(model, batch) -> ((loss, aux), grads)`, the one place
  where the parallel forms of the loss are chosen;
- `loss_fn()`: the same loss without gradients, for validation.

A single device is the same protocol: `Strategy()`. The parameter tree never
changes: context attention swaps the attention *kernel* (`Attention.with_kernel`),
manual tensor parallelism swaps leaf layers inside its `shard_map` only, the
pipeline re-stacks layers inside its program only. So a checkpoint written under
any strategy restores under any other.

Every mesh axis larger than 1 must be used by some part of the strategy, or
`Strategy` raises `ValueError` before anything compiles: a silent replica
repeating the same work is a bug, not a configuration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jax
from jax.sharding import Mesh
from jaxtyping import Array, PRNGKeyArray, PyTree

from eqgpt.data.batch import Batch
from eqgpt.nn.loss import lm_loss
from eqgpt.nn.protocol import num_layers
from eqgpt.parallel.mesh import make_mesh
from eqgpt.parallel.offload import (
    check_host_memory,
    place_on_device,
    place_on_host,
    to_device,
    to_host,
)
from eqgpt.parallel.placement import Placement, ShardedPlacement, SingleDevice
from eqgpt.parallel.rules import Rules, preset_rules
from eqgpt.precision import Policy

LossFn = Callable[[PyTree, Batch], tuple[Array, dict[str, Array]]]
GradFn = Callable[[PyTree, Batch], tuple[tuple[Array, dict[str, Array]], PyTree]]


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline over the mesh's `pipeline` axis.

    **Fields:** `schedule` ("gpipe", "1f1b" or "interleaved"), `microbatches`
    per step, `virtual_stages` (chunks per device, "interleaved" only).
    """

    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 2

    def __post_init__(self):
        if self.microbatches < 1 or self.virtual_stages < 1:
            raise ValueError(f"microbatches and virtual_stages must be >= 1, got {self}.")


def lm_batch_loss(model: PyTree, batch: Batch, *, chunk_size: int = 128, z_loss: float = 0.0):
    """`eqgpt.nn.lm_loss` of `model` on a `Batch` (the single-device and automatic-path loss).

    Per-row `batch.positions` (packed documents) feed the position embeddings and RoPE.
    """
    return lm_loss(model, batch.tokens, batch.targets, loss_mask=batch.loss_mask,
                   segment_ids=batch.segment_ids, chunk_size=chunk_size, z_loss=z_loss,
                   doc_positions=batch.positions)


@dataclass(frozen=True)
class Strategy:
    """A parallelism, described once; also the `Placement` of its model and batches.

    **Fields:**

    - `mesh`: a mesh from `make_mesh`, or `None` for one device.
    - `rules`: a rule set or a preset string (`"dp"`, `"fsdp+tp"`, `"dp+sp"`, ...).
    - `pipeline`: a `PipelineConfig` to run the layers as a pipeline over `pipeline`.
    - `context`: an `eqgpt.parallel.context.ContextConfig` to split the sequence
      over `context` with ring or all-gather attention.
    - `manual`: run data and tensor (and, with `sp` in `rules`, sequence)
      parallelism under `shard_map` with explicit collectives.
    - `overrides`: per-module rule sets (see `eqgpt.parallel.auto`).
    - `zero`: 1 or 2 to split the optimizer state over `data` while parameters stay
      replicated (ZeRO-1: gradients all-reduced; ZeRO-2: reduce-scattered); see
      `eqgpt.parallel.zero`.
    - `offload_opt_state`: keep the optimizer state in pinned host memory between
      steps (`eqgpt.parallel.offload`).
    - `offload_params`: keep the model's arrays there too (with FSDP each device's
      shard): the step copies them in before the forward pass and the updated ones out.

    Build from flags with `Strategy.parse("data=2,tensor=2", "dp+tp", ...)`.
    """

    mesh: Mesh | None = None
    rules: Rules | str = "dp"
    pipeline: PipelineConfig | None = None
    context: Any = None  # eqgpt.parallel.context.ContextConfig
    manual: bool = False
    overrides: Mapping[str, Rules] | None = None
    zero: Literal[0, 1, 2] = 0
    offload_opt_state: bool = False
    offload_params: bool = False

    def __post_init__(self):
        object.__setattr__(self, "rules", preset_rules(self.rules))
        if self.offload_opt_state or self.offload_params:
            check_host_memory()
        if self.zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0, 1 or 2 (ZeRO stage), got {self.zero!r}.")
        if self.mesh is None:
            parts = [n for n, v in (("pipeline", self.pipeline), ("context", self.context),
                                    ("manual", self.manual), (f"zero={self.zero}", self.zero)) if v]
            if parts:
                raise ValueError(f"{', '.join(parts)} needs a mesh, e.g. --mesh pipeline=2,data=2; "
                                 "one device runs none of them.")
            return
        if self.manual and (self.pipeline or self.context):
            raise ValueError("the manual path runs data, tensor and sequence parallelism only; drop --manual "
                             "to combine pipeline or context parallelism (they run on the automatic path).")
        if self.manual and "fsdp" in self.rules.uses("params", self.mesh):
            raise ValueError("the manual path has no FSDP; use --strategy dp+tp (or dp+sp) with --manual.")
        if self.zero:
            from eqgpt.parallel.zero import check_zero

            check_zero(self)
        if self.context is not None and "context" not in self.rules.axes("seq", "activations"):
            from eqgpt.parallel.context import context_rules

            object.__setattr__(self, "rules", context_rules(self.rules))
        unused = [a for a in self.mesh.axis_names if self.mesh.shape[a] > 1 and a not in self.axes_used]
        if unused:
            hints = {"data": "add 'dp' to --strategy", "fsdp": "add 'fsdp' to --strategy",
                     "tensor": "add 'tp' or 'sp' to --strategy", "pipeline": "add --pipeline 1f1b",
                     "context": "add --context ring"}
            raise ValueError(
                f"mesh axes {unused} (sizes {[self.mesh.shape[a] for a in unused]}) are used by no part of "
                f"strategy {self.describe()!r}: their devices would repeat the same work. "
                + "; ".join(f"{a}: {hints[a]}" for a in unused) + ", or drop the axis from --mesh."
            )

    # ------------------------------------------------------------------ construction

    @classmethod
    def parse(
        cls,
        mesh: str = "",
        rules: str = "dp",
        *,
        pipeline: str | None = None,
        microbatches: int = 4,
        virtual_stages: int = 2,
        context: str | None = None,
        manual: bool = False,
        zero: Literal[0, 1, 2] = 0,
        offload_opt_state: bool = False,
        offload_params: bool = False,
    ) -> Strategy:
        """A strategy from recipe flags: `--mesh`, `--strategy`, `--pipeline`, `--context`, `--manual`.

        **Arguments:** `mesh` ("" for one device, else e.g. "pipeline=2,data=2,tensor=2"),
        `rules` (presets joined by `+`), `pipeline` (a schedule name or `None`),
        `microbatches`, `virtual_stages`, `context` ("ring", "allgather" or `None`),
        `manual`, `zero` (ZeRO stage 0, 1 or 2), `offload_opt_state`, `offload_params`.
        """
        pipe = PipelineConfig(pipeline, microbatches, virtual_stages) if pipeline else None
        ctx = None
        if context:
            from eqgpt.parallel.context import ContextConfig

            ctx = ContextConfig(impl=context)
        return cls(make_mesh(mesh) if mesh else None, rules, pipe, ctx, manual, zero=zero,
                   offload_opt_state=offload_opt_state, offload_params=offload_params)

    # ------------------------------------------------------------------ what it uses

    @property
    def axes_used(self) -> tuple[str, ...]:
        """Mesh axes some part of this strategy splits work over."""
        if self.mesh is None:
            return ()
        used = {a for r in (self.rules, *(self.overrides or {}).values())
                for kind in ("params", "activations") for a in r.uses(kind, self.mesh)}
        if self.pipeline is not None:
            used |= {"pipeline", "data", "fsdp"}  # the pipeline splits microbatch rows over data and fsdp
        if self.manual:
            used |= {"data", "tensor"}
        if self.zero:
            used |= {"data"}  # the optimizer state is split over data
        return tuple(a for a in self.mesh.axis_names if a in used and self.mesh.shape[a] > 1)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the rules split the residual stream's sequence over `tensor` (`sp`)."""
        return "tensor" in self.rules.axes("seq", "activations")

    def describe(self) -> str:
        """A one-line label: `fsdp+tp | pipeline 1f1b m=8 | context ring | manual`."""
        on_host = [what for what, flag in (("parameters", self.offload_params),
                                           ("optimizer state", self.offload_opt_state)) if flag]
        offload = f" | {' and '.join(on_host)} on host" if on_host else ""
        if self.mesh is None:
            return "single device" + offload
        parts = [self.rules.name]
        if self.pipeline:
            parts.append(f"pipeline {self.pipeline.schedule} m={self.pipeline.microbatches}")
        if self.context:
            parts.append(f"context {self.context.impl}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.manual:
            parts.append("manual")
        return " | ".join(parts) + offload

    def __repr__(self) -> str:
        mesh = "one device" if self.mesh is None else ",".join(f"{a}={n}" for a, n in self.mesh.shape.items() if n > 1)
        return f"Strategy({mesh or 'one device'}: {self.describe()})"

    # ------------------------------------------------------------------ placement

    def placement_for(self, model_like: PyTree) -> Placement:
        """The placement of `model_like` (a model or its `eqx.filter_eval_shape`)."""
        if self.mesh is None:
            return SingleDevice()
        if self.zero:
            from eqgpt.parallel.zero import ZeroPlacement

            return ZeroPlacement(self.mesh, self.param_rules, self.overrides)
        if self.manual:
            from eqgpt.parallel.manual import manual_placement

            return manual_placement(self.mesh, model_like)
        return ShardedPlacement(self.mesh, self.param_rules, self.overrides)

    @property
    def param_rules(self) -> Rules:
        """The rules parameters are placed by: `rules`, and under a pipeline `layers` over `pipeline`."""
        if self.pipeline is None:
            return self.rules
        from eqgpt.parallel.pipeline import PP

        return self.rules.merge(PP).update(name=self.rules.name)

    @property
    def batch_divisor(self) -> int:
        """Pieces the batch's rows are split into by the placement (not counting microbatches)."""
        if self.mesh is None:
            return 1
        axes = set(self.rules.axes("batch", "activations"))
        if self.pipeline is not None or self.manual:
            axes |= {"data", "fsdp"} if self.pipeline is not None else {"data"}
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def rows_divisor(self) -> int:
        """What the global batch size must be a multiple of (devices x pipeline microbatches)."""
        return self.batch_divisor * (self.pipeline.microbatches if self.pipeline else 1)

    def prepare(self, model: PyTree) -> PyTree:
        """Install what the strategy needs into the model (context kernels; with
        `offload_params` its arrays move to host memory)."""
        model = place_on_host(model) if self.offload_params else model
        if self.context is None or self.mesh is None:
            return model
        from eqgpt.parallel.context import use_context_attention

        return use_context_attention(model, self.mesh, self.context)

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, created directly in its sharding, with the strategy's kernels installed."""
        abstract = jax.eval_shape(make, key) if self.manual else None
        return self.prepare(self.placement_for(abstract).init_model(make, key))

    def place_model(self, model: PyTree) -> PyTree:
        """An existing model (any placement, any strategy's kernels) moved into this strategy's layout."""
        from eqgpt.parallel.context import strip_context_attention

        model = strip_context_attention(model)
        return self.prepare(self.placement_for(model).place_model(model))

    def init_opt_state(self, optimizer: Any, model: PyTree) -> PyTree:
        """The optimizer state, each moment created next to its parameter (in host memory
        with `offload_opt_state`)."""
        model = self.on_device(model)  # created from device copies, whatever `offload_params`
        return self._offloaded(self.placement_for(model).init_opt_state(optimizer, model))

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """An existing optimizer state moved next to its parameters."""
        model = self.on_device(model)
        return self._offloaded(self.placement_for(model).place_opt_state(opt_state, model))

    def _offloaded(self, opt_state: PyTree) -> PyTree:
        return place_on_host(opt_state) if self.offload_opt_state else opt_state

    def fetch_opt_state(self, opt_state: PyTree) -> PyTree:
        """Inside the step: the optimizer state where the update reads it (device memory)."""
        return to_device(opt_state) if self.offload_opt_state else opt_state

    def stash_opt_state(self, opt_state: PyTree) -> PyTree:
        """Inside the step: the updated optimizer state where it lives between steps."""
        return to_host(opt_state) if self.offload_opt_state else opt_state

    def fetch_params(self, model: PyTree) -> PyTree:
        """Inside a compiled function: the model with its arrays in device memory."""
        return to_device(model) if self.offload_params else model

    def stash_params(self, model: PyTree) -> PyTree:
        """Inside the step: the updated model where it lives between steps."""
        return to_host(model) if self.offload_params else model

    def on_device(self, model: PyTree) -> PyTree:
        """Outside `jit`: the model with its arrays in device memory (to sample from or export)."""
        return place_on_device(model) if self.offload_params else model

    def batch(self, local: PyTree) -> PyTree:
        """Global arrays from this process's rows (a `Batch`): rows split as the strategy's loss expects."""
        if self.mesh is None:
            return SingleDevice().batch(local)
        rules = self.rules
        if self.pipeline is not None:
            rules = Rules(activations={"batch": ("data", "fsdp")}, name="pipeline-batch")
        elif self.manual:
            rules = Rules(activations={"batch": "data"}, name="manual-batch")
        return ShardedPlacement(self.mesh, rules).batch(local)

    # ------------------------------------------------------------------ checks

    def check(self, model_like: PyTree, *, batch_size: int, seq_len: int, accum_steps: int = 1) -> None:
        """Raise `ValueError`, before anything compiles, for sizes this strategy cannot split.

        **Arguments:** the model (or its `eqx.filter_eval_shape`), the global
        `batch_size` and `seq_len` of a training step, and `accum_steps`.
        """
        if accum_steps < 1 or batch_size % accum_steps:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by accum_steps ({accum_steps}).")
        rows = batch_size // accum_steps
        if self.mesh is None:
            return
        if rows % self.rows_divisor:
            micro = f" x {self.pipeline.microbatches} microbatches" if self.pipeline else ""
            raise ValueError(
                f"batch of {rows} rows per step{' (after accumulation)' if accum_steps > 1 else ''} is not "
                f"divisible by {self.batch_divisor} data-parallel devices{micro} = {self.rows_divisor}; "
                f"use a --batch-size that is a multiple of {self.rows_divisor * accum_steps}."
            )
        config = getattr(model_like, "config", None)
        if config is not None and not self.manual:
            from eqgpt.parallel.auto import check_divisibility

            check_divisibility(config, self.mesh, self.rules, rows // (self.pipeline.microbatches if self.pipeline
                                                                       else 1), seq_len, self.overrides)
        if self.context is not None:
            from eqgpt.parallel.context import check_layout

            check_layout(seq_len, self.mesh.shape["context"], self.context.ordering)
        if self.pipeline is not None:
            from eqgpt.parallel.pipeline import check_pipeline

            check_pipeline(num_layers(model_like), self.mesh, self.pipeline_schedule(), context=self.context)
        if self.manual:
            from eqgpt.parallel.tensor import check_tensor_parallel

            check_tensor_parallel(model_like, self.mesh.shape["tensor"])
            if self.sequence_parallel and seq_len % self.mesh.shape["tensor"]:
                raise ValueError(f"sequence parallelism splits the sequence over tensor={self.mesh.shape['tensor']}"
                                 f" devices; use a seq_len divisible by it (got {seq_len}).")

    def pipeline_schedule(self):
        """The pipeline `Schedule` on this mesh (a table of what each stage does at each tick)."""
        from eqgpt.parallel.pipeline import make_pipeline_schedule

        p = self.pipeline
        return make_pipeline_schedule(p.schedule, self.mesh.shape["pipeline"], p.microbatches, p.virtual_stages)

    # ------------------------------------------------------------------ the loss

    def loss_fn(self, *, chunk_size: int = 128, z_loss: float = 0.0, model_like: PyTree = None) -> LossFn:
        """`loss_fn(model, batch) -> (loss, aux)` in this strategy's layout (validation; no gradients).

        `model_like` (the model or its `eqx.filter_eval_shape`) is needed by the manual path only.
        With `offload_params` it reads the model from host memory.
        """
        loss = self._loss_fn(chunk_size, z_loss, model_like)
        if not self.offload_params:
            return loss
        return lambda model, batch: loss(self.fetch_params(model), batch)

    def _loss_fn(self, chunk_size: int, z_loss: float, model_like: PyTree) -> LossFn:
        if self.manual:
            from eqgpt.parallel.manual import manual_loss_fn

            return manual_loss_fn(model_like, self.mesh, sequence_parallel=self.sequence_parallel,
                                  chunk_size=chunk_size, z_loss=z_loss)
        if self.context is not None:
            from eqgpt.parallel.context import context_loss_fn

            return context_loss_fn(self.mesh, ordering=self.context.ordering, chunk_size=chunk_size, z_loss=z_loss)
        # One device, the automatic path, and validation of a pipelined model (the
        # partitioner runs the layers where the pipeline placed them).
        return lambda model, batch: lm_batch_loss(model, batch, chunk_size=chunk_size, z_loss=z_loss)

    def grad_fn(
        self, policy: Policy | None = None, *, chunk_size: int = 128, z_loss: float = 0.0, model_like: PyTree = None
    ) -> GradFn:
        """`grad_fn(model, batch) -> ((loss, aux), grads)` of this strategy, computing in `policy`.

        Loss and aux are fp32, gradients in the parameter dtype with the model's
        structure, already reduced over every axis the strategy splits the batch over.
        """
        policy = Policy() if policy is None else policy
        if self.pipeline is not None:
            from eqgpt.parallel.pipeline import pipeline_grad_fn

            return pipeline_grad_fn(self.mesh, self.pipeline_schedule(), rules=self.param_rules,
                                    chunk_size=chunk_size, z_loss=z_loss, policy=policy, context=self.context)
        if self.manual and self.zero:
            from eqgpt.parallel.zero import manual_zero_grad_fn

            return manual_zero_grad_fn(self.mesh, stage=self.zero, policy=policy, chunk_size=chunk_size,
                                       z_loss=z_loss)
        if self.manual:
            from eqgpt.parallel.manual import manual_grad_fn

            return manual_grad_fn(model_like, self.mesh, sequence_parallel=self.sequence_parallel,
                                  chunk_size=chunk_size, z_loss=z_loss, policy=policy)
        return policy.value_and_grad(self._loss_fn(chunk_size, z_loss, model_like))

    def sharded_update(self, update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]):
        """The optimizer update `update(grads, opt_state, params) -> (params, opt_state)` as this
        strategy runs it: unchanged, or under ZeRO on each device's block (`eqgpt.parallel.zero`)."""
        if not self.zero:
            return update
        from eqgpt.parallel.zero import zero_update

        return zero_update(update, self.mesh, stage=self.zero, rules=self.param_rules, overrides=self.overrides,
                           manual=self.manual)


__all__ = ["Strategy", "PipelineConfig", "GradFn", "LossFn", "lm_batch_loss"]
