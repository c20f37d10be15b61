"""Pipeline parallelism: GPipe, 1F1B or interleaved stages, with data parallelism beside it.

    .venv/bin/python recipes/pipeline.py                                  # pipeline=4,data=2, 1f1b, m=8
    .venv/bin/python recipes/pipeline.py --schedule interleaved --microbatches 8 --virtual-stages 2
    .venv/bin/python recipes/pipeline.py --mesh pipeline=2,data=2,tensor=2 --strategy dp+tp

The model's 8 layers are cut into p stages (v chunks each when interleaved); the
embedding runs on the first stage, the norm, head and loss on the last. Prints
the schedule table and its bubble, then trains a few AdamW steps and prints the
losses, the first loss of the same model on one device, and the compiled step's
collectives and memory. The same runs from the main recipe:
`train_gpt.py --mesh pipeline=2,data=2,tensor=2 --strategy dp+tp --pipeline 1f1b --microbatches 8`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import tyro

import eqgpt
from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt.parallel import Pipeline, Strategy, make_mesh
from eqgpt.parallel.pipeline import bubble_report
from eqgpt.parallel.pipeline.part import pipeline_schedule


@dataclass
class Args:
    """Train an 8-layer model as a pipeline and show its schedule."""

    mesh: str = "pipeline=4,data=2"
    """Mesh sizes; the 'pipeline' axis holds the stages."""
    strategy: str = "dp"
    """Rules for the other axes: dp, fsdp, dp+tp, ..."""
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"] = "1f1b"
    microbatches: int = 8
    virtual_stages: int = 2
    """Layer chunks per stage (interleaved)."""
    rows: int = 2
    """Rows per microbatch per data-parallel device."""
    steps: int = 5


def main(args: Args) -> list[float]:
    config = eqgpt.GPTConfig(vocab_size=256, seq_len=64, num_layers=8, num_heads=4, embed_dim=64)
    strategy = Strategy(make_mesh(args.mesh), args.strategy,
                        parts=(Pipeline(args.schedule, args.microbatches, args.virtual_stages),))
    schedule = pipeline_schedule(strategy.mesh, strategy.part(Pipeline))
    print(schedule.table())
    print(bubble_report(schedule))
    return train(strategy, config=config, steps=args.steps,
                 batch=args.microbatches * args.rows * strategy.batch_divisor)


if __name__ == "__main__":
    main(tyro.cli(Args))
