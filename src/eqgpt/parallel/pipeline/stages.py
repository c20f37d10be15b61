"""The pipeline's layout: its mesh axes, the sizes it can split, the layer stack over stages, the batch.

Uneven stages (`layers_per_stage`, see `balance`): every chunk holds as many
layer slots as the largest, its own layers first; a chunk then runs its slots one
at a time, each under a `lax.cond` on whether the slot holds a layer, so padding
computes nothing. With the equal split the chunk runs `run_blocks` whole.

`check_pipeline` refuses, before anything compiles, sizes the pipeline cannot split.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from einops import rearrange
from jax.sharding import Mesh
from jaxtyping import Array

from eqgpt.data.batch import Batch
from eqgpt.parallel.pipeline.balance import check_layers
from eqgpt.parallel.pipeline.schedules import Schedule
from eqgpt.parallel.rules import Rules, is_spec

PIPELINE = "pipeline"
BATCH_AXES = ("data", "fsdp")  # split the rows; parameters split over them are gathered per step
EXPERT = "expert"  # splits the rows too, and the experts, which stay split (eqgpt.parallel.expert)
ROW_AXES = (*BATCH_AXES, EXPERT)
MANUAL_AXES = (PIPELINE, *ROW_AXES)

#: Place the layer stack over the pipeline axis (merge into a strategy: `rules + PP`).
PP = Rules(params={"layers": PIPELINE}, name="pp")


# ------------------------------------------------------------------ checks


def check_pipeline(
    config_layers: int, mesh: Mesh, schedule: Schedule, batch_size: int | None = None, *, context: Any = None,
    layers_per_stage: tuple[int, ...] | str = "equal",
) -> None:
    """Raise `ValueError` (before anything compiles) for sizes the pipeline cannot split.

    **Arguments:** the model's number of layers, the `mesh`, the `schedule`,
    optionally the global `batch_size`, the `Context` part when the sequence
    is split over `context` too, and the split of the layers (`"equal"`, `"auto"`
    or a count per virtual stage).
    """
    missing = [a for a in (*MANUAL_AXES, "tensor") if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}; build the mesh with "
                         "eqgpt.parallel.make_mesh('pipeline=4,data=2').")
    p = mesh.shape[PIPELINE]
    if schedule.num_stages != p:
        raise ValueError(f"schedule {schedule.name!r} has {schedule.num_stages} stages but the mesh's "
                         f"pipeline axis has {p}; build the schedule with num_stages={p}.")
    if mesh.shape.get("context", 1) > 1 and not context:
        raise ValueError("the mesh has a context axis but the pipeline has no context attention; pass "
                         "context=Context('ring') (recipe: --context ring) or set context=1.")
    G = schedule.num_virtual_stages
    if not isinstance(layers_per_stage, str):
        check_layers(layers_per_stage, config_layers, G)
    elif layers_per_stage not in ("equal", "auto"):
        raise ValueError(f"layers_per_stage={layers_per_stage!r}: use 'equal', 'auto' or a count per virtual stage.")
    if config_layers % (p if layers_per_stage != "equal" else G):
        ok_p = [d for d in range(1, config_layers + 1) if config_layers % (d * schedule.num_chunks) == 0]
        ok_layers = [G * k for k in range(1, 5)]
        if layers_per_stage != "equal":  # the layer stack is still placed evenly over `pipeline`
            raise ValueError(f"num_layers={config_layers} is not divisible by the pipeline size {p}, over which "
                             "the layers are placed; choose a pipeline size that divides it.")
        raise ValueError(
            f"num_layers={config_layers} cannot be split into {p} stages x {schedule.num_chunks} chunks "
            f"= {G} virtual stages of equal depth; use pipeline size in {ok_p} for this model, "
            f"or num_layers in {ok_layers}... for this mesh, or layers_per_stage='auto' (a balanced split)."
        )
    if batch_size is not None:
        d = math.prod(mesh.shape.get(a, 1) for a in ROW_AXES)
        m = schedule.num_microbatches
        if batch_size % (d * m):
            raise ValueError(
                f"batch size {batch_size} is not divisible by {d} data-parallel devices x {m} "
                f"microbatches = {d * m}; use a batch that is a multiple of {d * m}, or change m."
            )


# ------------------------------------------------------------------ layouts


def to_stages(x: Array, p: int, v: int, layers_per_stage: tuple[int, ...] | None = None) -> Array:
    """`[L, ...]` layers -> `[p, v, L/(p v), ...]`: device `s` holds chunks `s, s+p, ...`.

    With `layers_per_stage` (a count per virtual stage `c p + s`) each chunk holds
    `max(layers_per_stage)` slots, its own layers first; the rest repeat layer 0 and
    are skipped (`stage_slots` says which slots hold a layer).
    """
    if layers_per_stage is None:
        return rearrange(x, "(v p l) ... -> p v l ...", p=p, v=v)
    index, _ = _slots(layers_per_stage)
    return rearrange(x[index], "(v p) l ... -> p v l ...", p=p, v=v)


def from_stages(x: Array, layers_per_stage: tuple[int, ...] | None = None) -> Array:
    """The inverse of `to_stages` (padding slots dropped)."""
    if layers_per_stage is None:
        return rearrange(x, "p v l ... -> (v p l) ...")
    _, used = _slots(layers_per_stage)
    return rearrange(x, "p v l ... -> (v p l) ...")[np.flatnonzero(used.reshape(-1))]


def stage_slots(p: int, v: int, layers_per_stage: tuple[int, ...]) -> np.ndarray:
    """`[p, v, max(layers_per_stage)]` booleans: which slots of `to_stages` hold a layer."""
    return rearrange(_slots(layers_per_stage)[1], "(v p) l -> p v l", p=p, v=v)


def _slots(layers_per_stage: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per virtual stage and slot: the layer it holds (0 in a padding slot), and whether it holds one."""
    width = max(max(layers_per_stage), 1)
    first = np.cumsum((0, *layers_per_stage[:-1]))
    slot = np.arange(width)
    used = slot[None, :] < np.asarray(layers_per_stage)[:, None]
    return np.where(used, first[:, None] + slot[None, :], 0), used


def split_model(model):
    """(block arrays, other arrays, static parts)."""
    params, static = eqx.partition(model, eqx.is_array)
    blocks = params.blocks
    return blocks, without_blocks(params), static


def without_blocks(tree):
    """A model-shaped tree with the `blocks` subtree emptied (all leaves `None`)."""
    return eqx.tree_at(lambda m: m.blocks, tree, replace_fn=lambda b: jax.tree.map(lambda _: None, b, is_leaf=is_spec))


def stage_model(rest, chunk_blocks, static):
    return eqx.combine(with_blocks(rest, chunk_blocks), static)


def with_blocks(tree, blocks):
    """`tree` (a model-shaped tree whose blocks are empty) with `blocks` put in."""
    return eqx.tree_at(lambda m: m.blocks, tree, blocks, is_leaf=lambda x: x is None)


def batch_fields(batch: Any) -> dict[str, Array]:
    """The batch's arrays as `{tokens, targets[, loss_mask, segment_ids]}`, each `[batch, seq]`."""
    if not isinstance(batch, Batch):
        raise ValueError(f"a pipeline batch is an eqgpt.data.Batch; got {type(batch).__name__} "
                         "(Batch.from_windows splits [batch, seq + 1] token windows).")
    if batch.positions is not None:
        raise ValueError("Batch.positions (per-row positions of packed documents) are not supported by the "
                         "pipeline yet; use one device, the automatic path or context parallelism.")
    fields = {"tokens": batch.tokens, "targets": batch.targets, "loss_mask": batch.loss_mask,
              "segment_ids": batch.segment_ids}
    return {k: v for k, v in fields.items() if v is not None}


__all__ = ["PIPELINE", "BATCH_AXES", "EXPERT", "ROW_AXES", "MANUAL_AXES", "PP", "check_pipeline", "to_stages",
           "from_stages", "stage_slots", "split_model", "without_blocks", "stage_model", "with_blocks", "batch_fields"]
