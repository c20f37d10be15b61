"""Everything that knows about devices: strategies, meshes, rule sets, placements.

`Strategy` describes a parallelism once (a mesh, rules and its parts: `Pipeline`,
`Context`, `Expert`, `Zero`, `Manual`, `Offload`, `Overlap`) and gives the trainer its
placement and loss/grad function; `ParallelFlags` is the same as command-line flags. The
automatic path lives here (`mesh`, `rules`, `auto`, `placement`); manual `shard_map`
forms live in their own modules (`collectives`, `tensor`, `sequence`, `manual`,
`context`, `pipeline`) and are imported from there.
"""

from eqgpt.parallel.auto import (
    ShardingConstraint,
    batch_sharding,
    check_divisibility,
    check_replication,
    init_opt_state_sharded,
    init_sharded,
    lower_init,
    opt_state_shardings,
    param_shardings,
    param_specs,
    path_str,
    place_model,
    place_opt_state,
    replicated_fraction,
    rules_for,
    with_constraints,
)
from eqgpt.parallel.context.part import Context
from eqgpt.parallel.expert import Expert
from eqgpt.parallel.flags import ParallelFlags
from eqgpt.parallel.manual import Manual
from eqgpt.parallel.mesh import AXES, MeshConfig, make_mesh, mesh_config
from eqgpt.parallel.offload import Offload
from eqgpt.parallel.overlap import Overlap
from eqgpt.parallel.part import Part
from eqgpt.parallel.pipeline.part import Pipeline
from eqgpt.parallel.placement import Placement, ShardedPlacement, SingleDevice
from eqgpt.parallel.rules import (
    DP,
    FSDP,
    PRESET_RULES,
    REPLICATED,
    SP,
    TP,
    AxisTable,
    Rules,
    preset_rules,
)
from eqgpt.parallel.strategy import Strategy
from eqgpt.parallel.zero import Zero

__all__ = [
    "AXES", "MeshConfig", "make_mesh", "mesh_config", "Rules", "AxisTable", "preset_rules",
    "PRESET_RULES", "DP", "FSDP", "TP", "SP", "REPLICATED", "ShardingConstraint",
    "param_specs", "param_shardings", "with_constraints", "place_model", "init_sharded", "lower_init",
    "opt_state_shardings", "place_opt_state", "init_opt_state_sharded", "batch_sharding",
    "replicated_fraction", "check_replication", "check_divisibility", "rules_for", "path_str",
    "ShardedPlacement", "SingleDevice", "Placement", "Strategy", "ParallelFlags",
    "Part", "Pipeline", "Context", "Expert", "Zero", "Manual", "Offload", "Overlap",
]
