"""Run any pipeline schedule as one SPMD program: `pipeline_grad_fn`.

The program is a `jax.shard_map` that is manual over the `pipeline`, `data` and
`fsdp` axes, and a `jax.lax.scan` over the schedule's ticks inside it. At every
tick each device looks up its instruction (`lowering.lower`) and runs one branch
of a `jax.lax.switch`:

- *idle*: nothing (a bubble; its outgoing messages are zeros, never NaN);
- *forward* of chunk `c` for microbatch `i`: read the stage input from its slot
  (or embed the tokens on the first virtual stage), run the chunk's layers, send
  the output to the next stage; on the last virtual stage add the microbatch's
  loss instead;
- *backward*: `jax.vjp` of the chunk, recomputed from the saved stage input, with
  the gradient that arrived from the next stage (or the loss on the last virtual
  stage); accumulate the parameter gradients and send the input gradient back;
- split schedules (`Schedule.split_backward`, ZB-H1) replace *backward* by two
  branches: *input gradient* (B), the `jax.vjp` of the recomputed chunk with
  respect to its input only (the parameters closed over as constants, so XLA
  computes no weight-gradient product), sent back at once; and *weight gradient*
  (W), the `jax.vjp` with respect to the parameters only, recomputed later from
  the same saved input and incoming gradient (both kept until W), accumulated and
  sent nowhere. The gradients are 1F1B's; each of B and W recomputes the forward,
  and W also the chain of activation gradients inside the chunk.

Whether a virtual stage is the first (embedding) or the last (norm, head, loss)
is a traced flag tested with `lax.cond` inside the branch, so the program has
three branches (four when split) whatever the schedule. The loss is added only on the last
virtual stage (an MoE layer's auxiliary losses on the stage that runs it) and
summed over stages once, after the loop.

Uneven stages (`layers_per_stage`): see `stages`; every chunk holds as many layer slots as the
largest, and padding slots compute nothing.

After the branch, two `ppermute`s move the outgoing activation one stage forward
and the outgoing gradient one stage back (around the ring when stages hold
several chunks); the receiver stores each in the slot the lowering chose.

Data parallelism: the batch is split over `data` and `fsdp`; every device accumulates *local*
gradients over its microbatches and the step reduces them once at the end (`reduce`). The `tensor`
axis is left to the automatic partitioner: weights the rules split over `tensor` stay split inside
each stage and XLA inserts the Megatron all-reduces.

Context parallelism (`context=Context(...)`, the part): the batch is put into the
layout (zigzag) once per step, before the program, by the part's hook
`split_sequence_in_stages` (which also swaps the kernels), and `context` joins the
manual axes: each device holds `T/n` positions of every microbatch, and the
model gets the global positions of its slots. The attention kernels are swapped
for all-gather (or Ulysses) `ContextKernel`s, which see that `context` is already manual and
run on the local shards directly; every other layer, the loss included, is per
position and needs nothing. Across `context` the step reduces exactly what it
reduces across `data`: the loss terms and, once at the end, every gradient (a
`psum`), since each device saw a share of the tokens. Per layer and microbatch
a context device gathers `(n-1)/n` of the keys and values in forward (and again
in the recomputing backward) and reduce-scatters their gradients: the ring's
volume, without its overlap. Two formulations do not work, and why:

- a `shard_map` over `context` nested in this one (the `ContextKernel` as the
  automatic path runs it): on JAX 0.10 its backward pass fails to lower, the
  nested manual computation re-binding the outer axes;
- ring attention inside a stage: its `ppermute`s run inside the tick's
  `lax.switch`, and stages take different branches in the same tick, while a
  collective-permute's rendezvous joins every device of the program (XLA:CPU
  deadlocks or pairs the wrong permutes). An all-gather's group is the context
  peers of one stage, which always take the same branch. So `impl="ring"` runs
  as all-gather here (logged once). Ulysses' all-to-alls have the same groups as
  the all-gather, and run as they are.

Precision: each stage casts its parameters to the policy's compute dtype inside
the differentiated function, and activations travel between stages in it;
gradients come back in the parameter dtype, the loss in fp32.

The model protocol (`eqgpt.nn.protocol.LanguageModel`): the executor reads a
model only through `embed(tokens, positions)`, `blocks` (layers stacked on a
leading axis), `run_blocks(x, positions, segment_ids)`, `norm(h)` and
`logits(h)`, so any model that has them runs as a pipeline. The layer count is
read from the arrays of `blocks`, the width from `jax.eval_shape` of `embed`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from einops import rearrange
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array

from eqgpt.config import MoEConfig
from eqgpt.data.batch import Batch
from eqgpt.nn.axes import NoConstraint, map_constraints
from eqgpt.nn.loss import chunked_cross_entropy
from eqgpt.nn.moe import MoEStats, moe_loss
from eqgpt.nn.protocol import check_language_model, num_layers
from eqgpt.parallel.auto import param_specs
from eqgpt.parallel.collectives import (
    all_reduce,
    ppermute,
    to_varying,
)
from eqgpt.parallel.pipeline.balance import (
    balanced_layers,
    check_layers,
    equal_layers,
    measure_costs,
)
from eqgpt.parallel.pipeline.lowering import (
    ACT_READ,
    ACT_WRITE,
    CHUNK,
    GRAD_READ,
    GRAD_WRITE,
    MICROBATCH,
    OP,
    lower,
)
from eqgpt.parallel.pipeline.reduce import batch_axes, gather_params, reduce_grads, sum_leaves
from eqgpt.parallel.pipeline.schedules import Schedule, bubble_report, make_pipeline_schedule
from eqgpt.parallel.pipeline.stages import (
    MANUAL_AXES,
    PIPELINE,
    ROW_AXES,
    batch_fields,
    check_pipeline,
    from_stages,
    split_model,
    stage_model,
    stage_slots,
    to_stages,
    with_blocks,
    without_blocks,
)
from eqgpt.parallel.rules import Rules, preset_rules
from eqgpt.parallel.shard_map import token_count
from eqgpt.precision import Policy, scale_value, unscale


@dataclass(frozen=True)
class _StepContext:
    """What the step's functions share and never change: one compiled program's settings.

    `static` is the model's non-array part; `block_axes`/`rest_axes` the `BatchAxes` of each block
    array and each other array; `width` the activation width; `seq_axes` the manual axes that split the
    sequence (`context`, or none); `moe` the model's `MoEConfig` (`moe_layers` MoE layers in all);
    `padded`: skip the layer slots `slots` marks empty (uneven `layers_per_stage`); `bucket_bytes`: the
    end-of-step gradient all-reduces in buckets (`reduce_grads`).
    """

    mesh: Mesh
    schedule: Schedule
    static: Any
    block_axes: Any
    rest_axes: Any
    width: int
    policy: Policy
    chunk_size: int
    z_loss: float
    seq_axes: tuple[str, ...] = ()
    moe: MoEConfig | None = None
    moe_layers: int = 0
    padded: bool = False
    bucket_bytes: int | None = None

    @property
    def manual(self) -> tuple[str, ...]:
        return (*MANUAL_AXES, *self.seq_axes)

    @property
    def token_axes(self) -> tuple[str, ...]:
        return (*ROW_AXES, *self.seq_axes)  # every device here holds a share of the tokens

    def vary(self, tree):
        return to_varying(tree, self.manual)


@dataclass(frozen=True)
class _StepValues:
    """What one step makes once, before its ticks, and every branch reads."""

    positions: Array  # the global position of each slot of the local sequence
    total: Array  # the step's count of loss tokens, over all devices
    scale: Array  # the loss scale (1 without dynamic loss scaling)
    rows: int  # rows of a microbatch, on this device
    seq: int  # positions of a row, on this device
    rows_total: int  # of the whole step
    seq_total: int
    zeros_act: Array
    no_terms: Array
    no_stats: MoEStats | None


def _make_step(ctx: _StepContext):
    """The `shard_map`ped step
    `(staged blocks, slots, other params, batch, positions, loss scale) -> (loss terms, grads, grads)`.

    `slots` (`stage_slots`, placed like the blocks) says which layer slots of each chunk hold a layer;
    `positions` the global position of each slot of the (possibly laid-out) sequence, split over
    `ctx.seq_axes` like the batch's. The backward pass starts from `d(loss) = loss scale` and the
    gradients are divided by it at the end (dynamic loss scaling; 1 without it).

    With `ctx.moe`, every stage adds its MoE layers' auxiliary losses to the loss term of each
    microbatch it runs forward, and their router statistics to the step's (`eqgpt.nn.moe.MoEStats`,
    summed over microbatches, stages and devices); the loss's cotangent is the loss scale on every stage.
    """
    block_specs = jax.tree.map(lambda ba: ba.spec((PIPELINE, None, None)), ctx.block_axes)
    rest_specs = jax.tree.map(lambda ba: ba.spec(), ctx.rest_axes)
    batch_spec = PartitionSpec(ROW_AXES, *ctx.seq_axes)
    lowered = lower(ctx.schedule)
    program = jnp.asarray(lowered.instructions)
    return jax.shard_map(
        functools.partial(_step, ctx, lowered, program), mesh=ctx.mesh,
        in_specs=(block_specs, PartitionSpec(PIPELINE), rest_specs, batch_spec, PartitionSpec(*ctx.seq_axes),
                  PartitionSpec()),
        out_specs=(PartitionSpec(), block_specs, rest_specs), axis_names=set(ctx.manual),
    )


def _step(ctx: _StepContext, lowered, program, blocks, slots, rest, batch, positions, scale):
    """One device's step: gather the parameters, scan `_tick` over the rows of `program` (the
    instructions of `lowered`), reduce once."""
    schedule, m = ctx.schedule, ctx.schedule.num_microbatches
    blocks = jax.tree.map(lambda a: a[0], blocks)  # [v, Lc, ...] on this stage
    slots = slots[0]
    blocks = ctx.vary(gather_params(blocks, ctx.block_axes, lead=2))
    rest = ctx.vary(gather_params(rest, ctx.rest_axes))
    bl, t = batch["tokens"].shape
    mb = bl // m
    micro = ctx.vary({k: rearrange(a, "(m b) ... -> m b ...", m=m) for k, a in batch.items()})
    total = token_count(batch.get("loss_mask"), (bl, t), ctx.token_axes)
    stage = jax.lax.axis_index(PIPELINE)
    act = ctx.policy.compute  # activations travel between stages in the compute dtype
    zeros_act = jnp.zeros((mb, t, ctx.width), act)
    no_terms = jnp.zeros((3,), jnp.float32)
    zero = jnp.float32(0)
    no_stats = None if ctx.moe is None else MoEStats(zero, zero, zero, jnp.zeros((ctx.moe.num_experts,)), zero)
    values = _StepValues(
        positions, total, scale, mb, t, rows_total=bl * math.prod(ctx.mesh.shape[a] for a in ROW_AXES),
        seq_total=t * math.prod(ctx.mesh.shape[a] for a in ctx.seq_axes), zeros_act=zeros_act, no_terms=no_terms,
        no_stats=no_stats,
    )
    # Indexed by the lowering's op codes: IDLE, FORWARD, BACKWARD (the input gradient when split), WEIGHT.
    kinds = [_idle, _forward, _input_grad, _weight_grad] if schedule.split_backward else [_idle, _forward, _backward]
    branches = [functools.partial(f, ctx, values) for f in kinds]
    tick = functools.partial(_tick, ctx, branches, stage, blocks, slots, rest, micro)
    init = ctx.vary((
        jnp.zeros((lowered.act_slots, mb, t, ctx.width), act),
        jnp.zeros((lowered.grad_slots, mb, t, ctx.width), act),
        jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), blocks),
        jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), rest),
        (values.no_terms, values.no_stats),
    ))
    (_, _, g_blocks, g_rest, terms), _ = jax.lax.scan(tick, init, program)
    return _reduce_step(ctx, terms, g_blocks, g_rest, scale)


def _tick(ctx: _StepContext, branches, stage, blocks, slots, rest, micro, carry, row_all):
    """One tick: this stage's branch, its gradients accumulated, its messages sent on."""
    p, v = ctx.schedule.num_stages, ctx.schedule.num_chunks
    ring = v > 1  # chunks wrap from the last stage back to the first
    fwd_perm = [(i, (i + 1) % p) for i in range(p if ring else p - 1)]
    bwd_perm = [(i, (i - 1) % p) for i in (range(p) if ring else range(1, p))]
    acts, grads_in, g_blocks, g_rest, terms = carry
    row = row_all[stage]
    c = row[CHUNK]
    chunk = jax.tree.map(lambda a: a[c], blocks)
    data = jax.tree.map(lambda a: a[row[MICROBATCH]], micro)
    x, dy = acts[row[ACT_READ]], grads_in[row[GRAD_READ]]
    g = c * p + stage  # the virtual stage
    send_f, send_b, d_chunk, d_rest, d_terms = jax.lax.switch(
        row[OP], branches, chunk, rest, x, dy, data, g == 0, g == p * v - 1, slots[c]
    )
    g_blocks = jax.tree.map(lambda acc, u: acc.at[c].add(u), g_blocks, d_chunk)
    g_rest = jax.tree.map(jnp.add, g_rest, d_rest)
    acts = acts.at[row[ACT_WRITE]].set(ppermute(send_f, PIPELINE, fwd_perm), mode="drop")
    grads_in = grads_in.at[row[GRAD_WRITE]].set(ppermute(send_b, PIPELINE, bwd_perm), mode="drop")
    return (acts, grads_in, g_blocks, g_rest, jax.tree.map(jnp.add, terms, d_terms)), None


def _reduce_step(ctx: _StepContext, terms, g_blocks, g_rest, scale):
    """Once per step: the loss terms summed over stages (the last stage's loss, every stage's MoE
    terms) and over the data-parallel devices; embedding/head gradients summed over stages; every
    gradient reduced over the devices that saw a share of the tokens, and unscaled."""
    token_axes, bucket_bytes = ctx.token_axes, ctx.bucket_bytes
    terms = all_reduce(terms, (PIPELINE, *token_axes))
    rest_leaves, rest_def = jax.tree.flatten(g_rest)
    g_rest = sum_leaves(rest_def, rest_leaves, [PIPELINE] * len(rest_leaves), bucket_bytes)
    g_rest = reduce_grads(g_rest, ctx.rest_axes, sum_axes=token_axes, bucket_bytes=bucket_bytes)
    g_blocks = reduce_grads(g_blocks, ctx.block_axes, lead=2, sum_axes=token_axes, bucket_bytes=bucket_bytes)
    g_blocks = jax.tree.map(lambda g: g[None], g_blocks)
    return terms, unscale(g_blocks, scale), unscale(g_rest, scale)


# ------------------------------------------------------------------ one virtual stage


def _layers(ctx: _StepContext, values: _StepValues, model, x, data):
    """Every layer of `model.blocks` on `x`: (output, MoE stats or None)."""
    if ctx.moe is None:
        return model.run_blocks(x, values.positions, data.get("segment_ids")), None
    return model.run_blocks_with_stats(x, values.positions, data.get("segment_ids"))


def _padded_layers(ctx: _StepContext, values: _StepValues, rest_p, chunk, x, data, used):
    """The chunk's layers one slot at a time, skipping the slots that hold none."""

    def slot(h, xs):
        params, on = xs
        model = stage_model(rest_p, jax.tree.map(lambda a: a[None], params), ctx.static)
        shapes = jax.eval_shape(lambda: _layers(ctx, values, model, h, data))
        skip = lambda h: ctx.vary((h, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[1])))  # noqa: E731
        return jax.lax.cond(on, lambda h: ctx.vary(_layers(ctx, values, model, h, data)), skip, h)

    h, stats = jax.lax.scan(slot, x, (chunk, used))
    return h, None if stats is None else jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)


def _run(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, data, first, last, used):
    """One virtual stage: (input, or tokens if `first`) -> (output, (loss terms if `last`, MoE stats))."""
    policy = ctx.policy
    rest_p, chunk = policy.cast_to_compute(rest_p), policy.cast_to_compute(chunk)
    model = stage_model(rest_p, chunk, ctx.static)
    x = jax.lax.cond(first, lambda: model.embed(data["tokens"], values.positions).astype(policy.compute), lambda: x)
    if ctx.padded:
        h, stats = _padded_layers(ctx, values, rest_p, chunk, x, data, used)
    else:
        h, stats = _layers(ctx, values, model, x, data)
    extra = 0.0
    if ctx.moe is not None:  # this chunk's MoE layers: their share of the step's auxiliary loss
        extra = moe_loss(stats._replace(layers=jnp.float32(ctx.moe_layers)), ctx.moe,
                         rows=values.rows_total, tokens=values.rows_total * values.seq_total)[0]
    loss_terms = functools.partial(_loss_terms, ctx, values, model, data)
    terms = jax.lax.cond(last, loss_terms, lambda h: ctx.vary(values.no_terms), h)
    return h, ctx.vary((terms.at[0].add(extra), stats))  # varying like the cotangents `backward` gives


def _loss_terms(ctx: _StepContext, values: _StepValues, model, data, h):
    """`[loss, nll, z_loss]` of this device's positions only (all of them, or its context shard):
    the mean over them, weighted by their share of all the step's tokens."""
    lm = data.get("loss_mask")
    loss, aux = chunked_cross_entropy(
        model.logits, model.norm(h), data["targets"], loss_mask=lm,
        chunk_size=ctx.chunk_size, z_loss=ctx.z_loss,
    )
    return token_count(lm, (values.rows, values.seq)) / values.total * jnp.stack([loss, aux["nll"], aux["z_loss"]])


# ------------------------------------------------------------------ the branches of a tick
# Each takes (chunk, rest params, stage input, incoming gradient, microbatch, first, last, used slots)
# and returns (activation sent on, gradient sent back, chunk grads, rest grads, (loss terms, MoE stats)).


def _idle(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, dy, data, first, last, used):
    zeros = jax.tree.map(jnp.zeros_like, (chunk, rest_p))
    return ctx.vary((values.zeros_act, values.zeros_act, *zeros, (values.no_terms, values.no_stats)))


def _forward(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, dy, data, first, last, used):
    y, terms = _run(ctx, values, chunk, rest_p, x, data, first, last, used)
    zeros = jax.tree.map(jnp.zeros_like, (chunk, rest_p))
    return ctx.vary((y.astype(ctx.policy.compute), values.zeros_act, *zeros, terms))


def _cotangents(ctx: _StepContext, values: _StepValues, last, dy, y, terms):
    """The gradient that came from the next stage (none on the last virtual stage), and
    d(loss) = the loss scale (1 unscaled): the last virtual stage's loss, every stage's MoE losses."""
    cot_terms = (jnp.stack([values.scale, 0.0, 0.0]), jax.tree.map(jnp.zeros_like, terms[1]))
    return jnp.where(last, 0.0, dy).astype(y.dtype), ctx.vary(cot_terms)


def _backward(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, dy, data, first, last, used):
    """Recompute the stage from its saved input, then pull back both gradients."""
    run = lambda c, r, x_: _run(ctx, values, c, r, x_, data, first, last, used)  # noqa: E731
    (y, terms), pullback = jax.vjp(run, chunk, rest_p, x)
    d_chunk, d_rest, dx = pullback(_cotangents(ctx, values, last, dy, y, terms))
    dx = jnp.where(first, 0.0, dx).astype(ctx.policy.compute)
    return ctx.vary((values.zeros_act, dx, d_chunk, d_rest, (values.no_terms, values.no_stats)))


def _input_grad(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, dy, data, first, last, used):
    """Split backward, B: the vjp with respect to the stage input only (the parameters are
    constants, so no weight-gradient product is computed), sent to the previous stage."""
    run = lambda x_: _run(ctx, values, chunk, rest_p, x_, data, first, last, used)  # noqa: E731
    (y, terms), pullback = jax.vjp(run, x)
    (dx,) = pullback(_cotangents(ctx, values, last, dy, y, terms))
    zeros = jax.tree.map(jnp.zeros_like, (chunk, rest_p))
    dx = jnp.where(first, 0.0, dx).astype(ctx.policy.compute)
    return ctx.vary((values.zeros_act, dx, *zeros, (values.no_terms, values.no_stats)))


def _weight_grad(ctx: _StepContext, values: _StepValues, chunk, rest_p, x, dy, data, first, last, used):
    """Split backward, W: the vjp with respect to the parameters only, recomputed from the
    same saved input and incoming gradient; nothing is sent."""
    run = lambda c, r: _run(ctx, values, c, r, x, data, first, last, used)  # noqa: E731
    (y, terms), pullback = jax.vjp(run, chunk, rest_p)
    d_chunk, d_rest = pullback(_cotangents(ctx, values, last, dy, y, terms))
    return ctx.vary((values.zeros_act, values.zeros_act, d_chunk, d_rest, (values.no_terms, values.no_stats)))


def pipeline_grad_fn(
    mesh: Mesh, schedule: Schedule | str, microbatches: int | None = None, *, virtual_stages: int = 2,
    rules: Rules | str | None = None, chunk_size: int = 128, z_loss: float = 0.0, policy: Policy | None = None,
    context: Any = None, layers_per_stage: tuple[int, ...] | str = "equal", bucket_bytes: int | None = None,
) -> PipelineGradFn:
    """A `grad_fn(model, batch) -> ((loss, aux), grads)` that runs a pipeline schedule.

    **Arguments:**

    - `mesh`: a mesh from `eqgpt.parallel.make_mesh` with a `pipeline` axis of size p
      (`data`, `fsdp`, `tensor` and, with `context`, `context` may be > 1).
    - `schedule`: a `Schedule`, or a name ("gpipe", "1f1b", "interleaved", "zb1") built
      with `microbatches` and, for "interleaved", `virtual_stages` chunks per stage.
    - `rules`: the rule set the parameters are placed with (e.g. `"fsdp+tp"`); it
      says which parameter dimensions are split over `fsdp`. `None`: replicated
      over `data`/`fsdp` (plain data parallelism).
    - `chunk_size`, `z_loss`: as in `eqgpt.nn.chunked_cross_entropy`.
    - `policy`: the precision `Policy`: each stage computes in its compute dtype and
      sends activations in it; gradients come back in the parameter dtype.
    - `context`: an `eqgpt.parallel.context.Context` when the sequence is also
      split over its `axis` (required when that axis is > 1). The batch is laid out
      once per step here and the model's `Attention` kernels are swapped for
      `ContextKernel`s for the step (already installed ones are fine; the caller's
      model is not changed).
    - `layers_per_stage`: `"equal"` (the same number of layers on every virtual
      stage), `"auto"` (`balance.balanced_layers`: the first and last stages
      take fewer layers for the embedding and the head, by measured FLOPs), or a
      count per virtual stage `chunk * p + stage`.
    - `bucket_bytes`: pack the end-of-step gradient all-reduces into fp32 buckets of
      at most this many bytes (`eqgpt.parallel.buckets`); `None`, one per array.

    **Returns:** the gradient function of a model that satisfies
    `eqgpt.nn.LanguageModel` and an `eqgpt.data.Batch` (without per-row
    `positions`); `loss` and `aux` (`nll`, `z_loss`) equal `eqgpt.nn.lm_loss` on
    the whole batch, in fp32, and `grads` has the model's structure, in the
    parameter dtype.
    """
    if policy is not None and policy.matmul == "int8":
        raise ValueError("--precision int8 does not run under --pipeline yet (its stages cast parts of the model); "
                         "use bf16 there, or int8 on a mesh without a pipeline axis.")
    if isinstance(schedule, str):
        if microbatches is None:
            raise ValueError(f"schedule {schedule!r} given by name needs microbatches=m.")
        schedule = make_pipeline_schedule(schedule, mesh.shape.get(PIPELINE, 1), microbatches, virtual_stages)
    elif microbatches is not None and microbatches != schedule.num_microbatches:
        raise ValueError(f"microbatches={microbatches} contradicts the schedule's "
                         f"{schedule.num_microbatches}; pass one or the other.")
    rules = None if rules is None else preset_rules(rules)
    check_pipeline(schedule.num_virtual_stages, mesh, schedule, context=context)  # mesh and schedule agree
    if not isinstance(layers_per_stage, str):
        layers_per_stage = tuple(int(n) for n in layers_per_stage)
        check_layers(layers_per_stage, sum(layers_per_stage), schedule.num_virtual_stages)
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
    return PipelineGradFn(mesh, schedule, rules, chunk_size, z_loss, Policy() if policy is None else policy, context,
                          layers_per_stage, bucket_bytes)


class PipelineGradFn:
    """The callable `pipeline_grad_fn` returns; also reports the schedule and compiled memory.

    **Attributes:** `mesh`, `schedule`, `rules`, `policy`, `context`, `layers_per_stage`, `bucket_bytes`.
    """

    def __init__(self, mesh: Mesh, schedule: Schedule, rules: Rules | None, chunk_size: int, z_loss: float,
                 policy: Policy, context: Any, layers_per_stage: tuple[int, ...] | str = "equal",
                 bucket_bytes: int | None = None):
        self.mesh, self.schedule, self.rules, self.policy, self.context = mesh, schedule, rules, policy, context
        self.chunk_size, self.z_loss, self.layers_per_stage = chunk_size, z_loss, layers_per_stage
        self.bucket_bytes = bucket_bytes
        self._splits: dict[tuple, tuple[int, ...]] = {}
        self._jitted = eqx.filter_jit(self._grad)

    def __repr__(self) -> str:
        return f"PipelineGradFn({self.schedule.name}, mesh={dict(self.mesh.shape)})"

    def __call__(self, model, batch: Any, loss_scale=None):
        """**Returns:** `((loss, aux), grads)` for `model` on `batch` (see `pipeline_grad_fn`);
        with `loss_scale`, the backward pass runs on `loss * loss_scale` (dynamic loss scaling)
        and the gradients are divided by it."""
        return self._jitted(model, batch, loss_scale)

    def compile(self, model, batch: Batch):
        """The compiled step (`jax.stages.Compiled`): for `memory_analysis()` and the HLO.

        `model` and `batch` may be abstract (`eqx.filter_eval_shape`, `jax.ShapeDtypeStruct`).
        """
        is_leaf = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
        dynamic, static = eqx.partition(model, is_leaf)
        step = jax.jit(lambda dyn, b: self._grad(eqx.combine(dyn, static), b))
        return step.lower(dynamic, batch).compile()

    def temp_bytes(self, model, batch: Batch) -> int:
        """Per-device temporary memory of the compiled step (`memory_analysis().temp_size_in_bytes`)."""
        stats = self.compile(model, batch).memory_analysis()
        if stats is None:
            raise ValueError("this backend returned no memory analysis for the program.")
        return stats.temp_size_in_bytes

    def report(self, model=None, batch: Batch | None = None) -> str:
        """The bubble of the schedule, and with `model` and `batch` the layers per stage and the compiled
        temp memory."""
        line = bubble_report(self.schedule)
        if model is not None and batch is not None:
            line += f"; layers per virtual stage {self.split(model, batch.tokens.shape)}"
            line += f"; temp memory {self.temp_bytes(model, batch) / 2**20:.2f} MiB per device"
        return line

    def microbatch(self, batch_shape: tuple[int, int]) -> tuple[int, int]:
        """The `(rows, seq)` one device runs per microbatch, of a global batch `batch_shape`."""
        rows = math.prod(self.mesh.shape[a] for a in ROW_AXES) * self.schedule.num_microbatches
        ctx = 1 if self.context is None else self.mesh.shape.get(self.context.sequence_axis, 1)
        return batch_shape[0] // rows, batch_shape[1] // ctx

    def split(self, model, batch_shape: tuple[int, int]) -> tuple[int, ...]:
        """The layers of each virtual stage for `model` on a global batch `batch_shape`
        (`layers_per_stage` resolved)."""
        L, G = num_layers(model), self.schedule.num_virtual_stages
        if not isinstance(self.layers_per_stage, str):
            return self.layers_per_stage
        if self.layers_per_stage == "equal":
            return equal_layers(L, G)
        key = (L, self.microbatch(batch_shape))
        if key not in self._splits:  # measured once per model size and batch shape
            self._splits[key] = balanced_layers(measure_costs(model, key[1]), L, G)
        return self._splits[key]

    def _grad(self, model, batch: Any, loss_scale=None):
        mesh, schedule, ctx = self.mesh, self.schedule, self.context
        p, v = schedule.num_stages, schedule.num_chunks
        check_language_model(model)
        fields = batch_fields(batch)
        b, t = fields["tokens"].shape
        L, G = num_layers(model), schedule.num_virtual_stages
        check_pipeline(L, mesh, schedule, b, context=ctx, layers_per_stage=self.layers_per_stage)
        counts = self.split(model, (b, t))
        padded = L % G != 0 or counts != equal_layers(L, G)
        layout = jax.tree.structure(eqx.filter(model, eqx.is_array))  # the caller's, hooks included
        param_dtypes = [a.dtype for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
        seq_axes: tuple[str, ...] = ()
        positions = jnp.arange(t)
        if ctx is not None and mesh.shape[ctx.sequence_axis] > 1:  # the sequence split: laid out once, here
            seq_axes = (ctx.sequence_axis,)
            model, fields, positions = ctx.split_sequence_in_stages(mesh, model, fields)
        # Inside the pipeline the activation hooks are identity (see the module docstring).
        model = map_constraints(model, lambda _path, _hook: NoConstraint())
        width = jax.eval_shape(model.embed, fields["tokens"][:1], positions).shape[-1]
        blocks, rest, static = split_model(model)
        if self.rules is None:
            specs = jax.tree.map(lambda a: PartitionSpec(), eqx.filter(model, eqx.is_array))
        else:
            specs = param_specs(eqx.filter(model, eqx.is_array), self.rules, mesh=mesh)
        block_axes = jax.tree.map(lambda a, sp: batch_axes(sp, a.ndim, drop_lead=True), blocks, specs.blocks)
        rest_axes = jax.tree.map(lambda a, sp: batch_axes(sp, a.ndim), rest, without_blocks(specs))
        moe, moe_layers = model.moe, model.num_moe_layers  # the MoE accessors of `eqgpt.nn.LanguageModel`
        step = _make_step(_StepContext(
            mesh, schedule, static, block_axes, rest_axes, width, self.policy, self.chunk_size, self.z_loss,
            seq_axes=seq_axes, moe=moe, moe_layers=moe_layers, padded=padded, bucket_bytes=self.bucket_bytes,
        ))
        stage_counts = counts if padded else None
        slots = jnp.asarray(stage_slots(p, v, counts))
        staged = jax.tree.map(lambda a: to_stages(a, p, v, stage_counts), blocks)
        (terms, stats), g_blocks, g_rest = step(staged, slots, rest, fields, positions, scale_value(loss_scale))
        grads = with_blocks(g_rest, jax.tree.map(lambda g: from_stages(g, stage_counts), g_blocks))
        leaves = [g.astype(dt) for g, dt in zip(jax.tree.leaves(grads), param_dtypes, strict=True)]
        aux = {"nll": terms[1], "z_loss": terms[2]}
        if moe is not None:
            # Every (stage, microbatch, device) counted its layers: the model has `moe_layers`.
            aux |= moe_loss(stats._replace(layers=jnp.float32(moe_layers)), moe, rows=b, tokens=b * t)[1]
        return (terms[0], aux), jax.tree.unflatten(layout, leaves)


__all__ = ["pipeline_grad_fn", "PipelineGradFn"]
