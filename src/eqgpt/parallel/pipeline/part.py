"""The pipeline as a `Strategy` part: `Pipeline`.

Layers are placed over `pipeline` (`PP` merged into the parameter rules), each
step's rows are split over `data`, `fsdp` and `expert` and into microbatches, and the
gradient is the schedule's (`pipeline_grad_fn`). Validation needs no pipeline:
the partitioner runs each layer where the pipeline placed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from jax.sharding import Mesh
from jaxtyping import PyTree

from eqgpt.nn.protocol import num_layers
from eqgpt.parallel.buckets import bucket_bytes_of
from eqgpt.parallel.part import GradFn, Part
from eqgpt.parallel.pipeline.executor import pipeline_grad_fn
from eqgpt.parallel.pipeline.schedules import Schedule, bubble_report, make_pipeline_schedule
from eqgpt.parallel.pipeline.stages import PP, ROW_AXES, check_pipeline
from eqgpt.parallel.rules import Rules
from eqgpt.precision import Policy

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy


def parse_layers(text: str) -> tuple[int, ...] | str:
    """`--pipeline-layers` text: "equal", "auto" or counts such as "4,4,4,0"."""
    if text in ("equal", "auto"):
        return text
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--pipeline-layers {text!r}: use 'equal', 'auto' or one count per virtual stage "
                         "(pipeline size x chunks), e.g. '4,4,4,0'.") from None


@dataclass(frozen=True)
class Pipeline(Part):
    """The layers as stages over the mesh's `pipeline` axis: `Pipeline("1f1b", microbatches=8)`.

    **Fields:** `schedule`, `microbatches` per step, `virtual_stages` (chunks per
    device, "interleaved" only), `layers_per_stage` ("equal", "auto": balanced by
    measured FLOPs, or a count per virtual stage such as `(4, 4, 4, 0)`; see
    `eqgpt.parallel.pipeline.balance`), `bucket_mb` (the end-of-step gradient
    all-reduces packed into fp32 buckets of at most this many MiB: `eqgpt.parallel.buckets`).
    """

    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = "1f1b"
    ("Run the layers as a pipeline over the mesh's 'pipeline' axis with this schedule (zb1: zero-bubble ZB-H1, needs "
     "--microbatches >= the pipeline size).")
    microbatches: int = field(default=4, metadata={"flag": "microbatches"})
    """Pipeline microbatches per step."""
    virtual_stages: int = field(default=2, metadata={"flag": "virtual_stages"})
    """Layer chunks per pipeline device (interleaved schedule)."""
    layers_per_stage: tuple[int, ...] | str = field(default="equal", metadata={"flag": "pipeline_layers", "cli": str})
    ("Layers per pipeline stage: 'equal', 'auto' (balanced by measured FLOPs: the embedding and head stages take "
     "fewer) or counts per virtual stage, e.g. '4,4,4,0'.")
    bucket_mb: float | None = field(default=None, metadata={"flag": "bucket_mb"})
    ("Pack the gradient all-reduces of --manual and --pipeline into fp32 buckets of at most this many MiB "
     "(docs/parallelism/dp.md).")

    name = "pipeline"
    order = 10
    hints = {"pipeline": "add --pipeline 1f1b"}
    on_manual_path = False
    runs_layers = True
    switch = "schedule"

    def __post_init__(self):
        if self.microbatches < 1 or self.virtual_stages < 1:
            raise ValueError(f"microbatches and virtual_stages must be >= 1, got {self}.")
        split = self.layers_per_stage
        if isinstance(split, str) and split not in ("equal", "auto"):
            object.__setattr__(self, "layers_per_stage", parse_layers(split))
        elif not isinstance(split, str):
            object.__setattr__(self, "layers_per_stage", tuple(int(n) for n in split))
        if self.bucket_mb is not None:
            bucket_bytes_of(self.bucket_mb)  # > 0

    def axes(self, strategy: Strategy) -> set[str]:
        return {"pipeline", "data", "fsdp"}  # microbatch rows are split over data and fsdp

    def validate(self, strategy: Strategy) -> None:
        if strategy.mesh.shape.get("pipeline", 1) < 2:
            raise ValueError(f"--pipeline {self.schedule} runs the layers over the mesh's 'pipeline' axis, and "
                             f"--mesh {','.join(f'{a}={n}' for a, n in strategy.mesh.shape.items() if n > 1)} "
                             "has none: add pipeline=N to --mesh, or drop "
                             "--pipeline.")

    def param_rules(self, strategy: Strategy, rules: Rules) -> Rules:
        return rules.merge(PP).update(name=rules.name)

    def batch_rules(self, strategy: Strategy) -> Rules:
        return Rules(activations={"batch": ROW_AXES}, name="pipeline-batch")

    def check(self, strategy: Strategy, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        check_pipeline(num_layers(model_like), strategy.mesh, pipeline_schedule(strategy.mesh, self),
                       context=_sequence_part(strategy), layers_per_stage=self.layers_per_stage)

    def grad_fn(self, strategy: Strategy, policy: Policy, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> GradFn:
        return pipeline_grad_fn(strategy.mesh, pipeline_schedule(strategy.mesh, self),
                                rules=strategy.param_rules, chunk_size=chunk_size, z_loss=z_loss, policy=policy,
                                context=_sequence_part(strategy), layers_per_stage=self.layers_per_stage,
                                bucket_bytes=bucket_bytes_of(self.bucket_mb))

    def notes(self, strategy: Strategy, model_like: PyTree, batch_shape: tuple[int, int]) -> list[str]:
        return [describe_stages(strategy, model_like, batch_shape)]

    def describe(self, strategy: Strategy) -> str:
        split = self.layers_per_stage
        split = "" if split == "equal" else f" layers={split if isinstance(split, str) else ','.join(map(str, split))}"
        buckets = "" if self.bucket_mb is None else f" buckets {self.bucket_mb:g} MiB"
        return f"pipeline {self.schedule} m={self.microbatches}{split}{buckets}"


def _sequence_part(strategy: Strategy) -> Any:
    """The part splitting the sequence (its kernels run inside the stages), or `None`."""
    return next((p for p in strategy.parts if p.sequence_axis is not None), None)


def pipeline_schedule(mesh: Mesh, pipeline: Pipeline) -> Schedule:
    """The `Schedule` of `pipeline` on `mesh` (a table of what each stage does at each tick)."""
    return make_pipeline_schedule(pipeline.schedule, mesh.shape["pipeline"], pipeline.microbatches,
                                  pipeline.virtual_stages)


def describe_stages(strategy: Strategy, model_like: PyTree, batch_shape: tuple[int, int]) -> str | None:
    """One line for a run's log: the schedule's bubble and the layers of each virtual stage
    (`None` without a pipeline).

    **Arguments:** a `Strategy`, the (abstract) model, the global batch `(rows, seq)`.
    """
    pipeline = strategy.part(Pipeline)
    if pipeline is None:
        return None
    fn = pipeline_grad_fn(strategy.mesh, pipeline_schedule(strategy.mesh, pipeline), context=_sequence_part(strategy),
                          layers_per_stage=pipeline.layers_per_stage)
    how = pipeline.layers_per_stage if isinstance(pipeline.layers_per_stage, str) else "given"
    if how == "auto":
        how = "auto: balanced by measured FLOPs"
    split = ",".join(map(str, fn.split(model_like, batch_shape)))
    return f"{bubble_report(fn.schedule)}; layers per virtual stage {split} ({how})"


__all__ = ["Pipeline", "pipeline_schedule", "describe_stages", "parse_layers"]
