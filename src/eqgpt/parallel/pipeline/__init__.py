"""Pipeline parallelism: schedules as data (`schedules`, `lowering`), one SPMD executor (`executor`),
the layout over stages (`stages`), the once-per-step reductions (`reduce`), and the layers each
stage runs (`balance`).

See `docs/parallelism/pipeline.md`.
"""

from eqgpt.parallel.pipeline.balance import (
    StageCosts,
    balance_table,
    balanced_layers,
    equal_layers,
    measure_costs,
    stage_flops,
)
from eqgpt.parallel.pipeline.executor import pipeline_grad_fn
from eqgpt.parallel.pipeline.lowering import Lowered, lower
from eqgpt.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    bubble_report,
    from_programs,
    gpipe,
    interleaved,
    make_pipeline_schedule,
    one_f_one_b,
    zero_bubble_h1,
)
from eqgpt.parallel.pipeline.stages import PP, check_pipeline, from_stages, stage_slots, to_stages

__all__ = [
    "Action", "Schedule", "SCHEDULES", "from_programs", "gpipe", "one_f_one_b", "interleaved", "zero_bubble_h1",
    "make_pipeline_schedule", "lower", "Lowered", "pipeline_grad_fn", "check_pipeline", "bubble_report",
    "PP", "to_stages", "from_stages", "stage_slots",
    "StageCosts", "balance_table", "equal_layers", "balanced_layers", "measure_costs", "stage_flops",
]
