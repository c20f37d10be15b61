"""The pipeline as a `Strategy` part: `PipelineConfig` and `PipelinePart`.

Layers are placed over `pipeline` (`PP` merged into the parameter rules), each
step's rows are split over `data`, `fsdp` and `expert` and into microbatches, and the
gradient is the schedule's (`pipeline_grad_fn`). Validation needs no pipeline:
the partitioner runs each layer where the pipeline placed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from jax.sharding import Mesh
from jaxtyping import PyTree

from eqgpt.nn.protocol import num_layers
from eqgpt.parallel.buckets import bucket_bytes_of
from eqgpt.parallel.part import GradFn, Part
from eqgpt.parallel.pipeline.executor import PP, ROW_AXES, bubble_report, check_pipeline, pipeline_grad_fn
from eqgpt.parallel.pipeline.schedules import Schedule, make_pipeline_schedule
from eqgpt.parallel.rules import Rules
from eqgpt.precision import Policy


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline over the mesh's `pipeline` axis.

    **Fields:** `schedule` ("gpipe", "1f1b", "interleaved" or "zb1", the zero-bubble
    ZB-H1, which needs `microbatches` >= the pipeline size), `microbatches`
    per step, `virtual_stages` (chunks per device, "interleaved" only),
    `layers_per_stage`: "equal", "auto" (balanced by measured FLOPs: the stages
    with the embedding and the head take fewer layers) or a count per virtual
    stage, e.g. `(4, 4, 4, 0)` (see `eqgpt.parallel.pipeline.balance`).
    """

    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 2
    layers_per_stage: tuple[int, ...] | Literal["equal", "auto"] = "equal"

    def __post_init__(self):
        if self.microbatches < 1 or self.virtual_stages < 1:
            raise ValueError(f"microbatches and virtual_stages must be >= 1, got {self}.")
        split = self.layers_per_stage
        if isinstance(split, str) and split not in ("equal", "auto"):
            raise ValueError(f"layers_per_stage={split!r}: use 'equal', 'auto' or a count per virtual stage.")
        if not isinstance(split, str):
            object.__setattr__(self, "layers_per_stage", tuple(int(n) for n in split))

    @classmethod
    def parse_layers(cls, text: str) -> tuple[int, ...] | str:
        """`--pipeline-layers` text: "equal", "auto" or counts such as "4,4,4,0"."""
        if text in ("equal", "auto"):
            return text
        try:
            return tuple(int(n) for n in text.split(","))
        except ValueError:
            raise ValueError(f"--pipeline-layers {text!r}: use 'equal', 'auto' or one count per virtual stage "
                             "(pipeline size x chunks), e.g. '4,4,4,0'.") from None


def pipeline_schedule(mesh: Mesh, config: PipelineConfig) -> Schedule:
    """The `Schedule` of `config` on `mesh` (a table of what each stage does at each tick)."""
    return make_pipeline_schedule(config.schedule, mesh.shape["pipeline"], config.microbatches,
                                  config.virtual_stages)


def describe_stages(strategy: Any, model_like: PyTree, batch_shape: tuple[int, int]) -> str:
    """One line for a run's log: the schedule's bubble and the layers of each virtual stage.

    **Arguments:** a `Strategy` with a pipeline, the (abstract) model, the global batch `(rows, seq)`.
    """
    config = strategy.pipeline
    fn = pipeline_grad_fn(strategy.mesh, pipeline_schedule(strategy.mesh, config), context=strategy.context,
                          layers_per_stage=config.layers_per_stage)
    how = config.layers_per_stage if isinstance(config.layers_per_stage, str) else "given"
    if how == "auto":
        how = "auto: balanced by measured FLOPs"
    split = ",".join(map(str, fn.split(model_like, batch_shape)))
    return f"{bubble_report(fn.schedule)}; layers per virtual stage {split} ({how})"


@dataclass(frozen=True)
class PipelinePart(Part):
    """`Strategy(pipeline=PipelineConfig(...))`: layers as stages over `pipeline`."""

    config: PipelineConfig

    name = "pipeline"
    hints = {"pipeline": "add --pipeline 1f1b"}

    @classmethod
    def of(cls, strategy: Any) -> PipelinePart | None:
        return None if strategy.pipeline is None else cls(strategy.pipeline)

    @property
    def microbatches(self) -> int:
        return self.config.microbatches

    def axes(self, strategy: Any) -> set[str]:
        return {"pipeline", "data", "fsdp"}  # microbatch rows are split over data and fsdp

    def param_rules(self, strategy: Any, rules: Rules) -> Rules:
        return rules.merge(PP).update(name=rules.name)

    def batch_rules(self, strategy: Any) -> Rules:
        return Rules(activations={"batch": ROW_AXES}, name="pipeline-batch")

    def check(self, strategy: Any, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        check_pipeline(num_layers(model_like), strategy.mesh, pipeline_schedule(strategy.mesh, self.config),
                       context=strategy.context, layers_per_stage=self.config.layers_per_stage)

    def grad_fn(self, strategy: Any, policy: Policy, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> GradFn:
        return pipeline_grad_fn(strategy.mesh, pipeline_schedule(strategy.mesh, self.config),
                                rules=strategy.param_rules, chunk_size=chunk_size, z_loss=z_loss, policy=policy,
                                context=strategy.context, layers_per_stage=self.config.layers_per_stage,
                                bucket_bytes=bucket_bytes_of(strategy.bucket_mb))

    def describe(self, strategy: Any) -> str:
        split = self.config.layers_per_stage
        split = "" if split == "equal" else f" layers={split if isinstance(split, str) else ','.join(map(str, split))}"
        return f"pipeline {self.config.schedule} m={self.config.microbatches}{split}"


__all__ = ["PipelineConfig", "PipelinePart", "pipeline_schedule", "describe_stages"]
