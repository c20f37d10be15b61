"""`make_train_step`: loss and gradients (with accumulation), a guard, the update.

The step is one compiled function `state, batch -> state, metrics` whose state
buffers are donated, so the old and the new state never coexist in memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PyTree

from eqgpt.data.batch import Batch
from eqgpt.nn.kernels.platform import compiling_for, platform_of
from eqgpt.parallel.offload import Offload
from eqgpt.parallel.strategy import GradFn, Strategy
from eqgpt.precision import Policy
from eqgpt.train.state import TrainState


def accumulate(grad_fn: GradFn, model: PyTree, batch: Batch, accum_steps: int):
    """Mean loss, aux and gradients over `accum_steps` microbatches, with `jax.lax.scan`.

    Every field's rows are split into `[accum_steps, batch / accum_steps]`;
    sums are kept in fp32. Equal to one step on the whole batch when the loss is a
    mean over equally many tokens per microbatch (as `lm_loss` without a mask).
    """
    if accum_steps == 1:
        return grad_fn(model, batch)
    rows = batch.shape[0]
    if rows % accum_steps:
        raise ValueError(
            f"batch of {rows} rows cannot be split into {accum_steps} microbatches; "
            f"use a batch size divisible by accum_steps."
        )
    micro = jax.tree.map(lambda a: a.reshape(accum_steps, rows // accum_steps, *a.shape[1:]), batch)
    (loss0, aux0), grads0 = jax.eval_shape(grad_fn, model, jax.tree.map(lambda a: a[0], micro))
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)  # noqa: E731
    carry0 = (zeros(loss0), zeros(aux0), zeros(grads0))

    def body(carry, mb):
        (loss, aux), grads = grad_fn(model, mb)
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)  # noqa: E731
        return (add(carry[0], loss), add(carry[1], aux), add(carry[2], grads)), None

    (loss, aux, grads), _ = jax.lax.scan(body, carry0, micro)
    mean = lambda t, like: jax.tree.map(lambda x, s: (x / accum_steps).astype(s.dtype), t, like)  # noqa: E731
    return (mean(loss, loss0), mean(aux, aux0)), mean(grads, grads0)


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    strategy: Strategy | None = None,
    policy: Policy | None = None,
    accum_steps: int = 1,
    z_loss: float = 0.0,
    model_like: PyTree = None,
    grad_fn: GradFn | None = None,
    donate: bool = True,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]:
    """The compiled training step of every strategy.

    **Arguments:**

    - `optimizer`: an optax transformation over `eqx.filter(model, eqx.is_array)`.
    - `strategy`: the parallelism (`eqgpt.parallel.Strategy`); default one device.
    - `policy`: the mixed-precision `Policy`, applied by every strategy.
    - `accum_steps`: microbatches per step, accumulated with `jax.lax.scan`.
    - `z_loss`: weight of the z-loss term (see `eqgpt.nn.chunked_cross_entropy`).
    - `model_like`: the model (or `eqx.filter_eval_shape` of it); the manual path needs it.
    - `grad_fn`: your own `(model, batch) -> ((loss, aux), grads)` instead of the
      strategy's; it then owns its precision, so `policy` must not be given.
    - `donate`: donate the state's buffers (the caller must not reuse the old state).

    **Returns:** `step(state, batch) -> (state, metrics)` with metrics `loss`,
    `grad_norm`, `skipped` (1 if this update was dropped) and the aux entries. If
    the loss or the gradients' global norm is not finite (a gradient that is not, or
    a norm beyond fp32's range), model and optimizer state are left unchanged,
    `state.skipped` grows by one and `state.step` still advances.

    The update runs as the strategy says (`Strategy.sharded_update`: ZeRO updates
    each device's block). With a loss-scaling policy the state carries a
    `LossScale` (`TrainState(..., loss_scale=policy.loss_scale_state())`): the
    gradients are computed with it, and it is adjusted after every step (metric
    `loss_scale`).
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
    if grad_fn is not None and (policy is not None or strategy is not None or z_loss):
        raise ValueError("make_train_step: give either grad_fn (which owns its loss and precision) or "
                         "strategy/policy/z_loss, not both.")
    scaling = policy is not None and policy.loss_scaling
    strategy = Strategy() if strategy is None else strategy
    if grad_fn is None:
        grad_fn = strategy.grad_fn(policy, z_loss=z_loss, model_like=model_like)

    optimizer = optax.with_extra_args_support(optimizer)

    def apply_update(grads, opt_state, params, **extra_args):
        # extra_args: optax extra arguments from the strategy (ZeRO's `norm_fn`)
        with jax.named_scope("optimizer"):  # named in traces (eqgpt.profile.trace)
            updates, new_opt = optimizer.update(grads, opt_state, params, **extra_args)
            return optax.apply_updates(params, updates), new_opt  # p + u in the wider dtype, rounded to p's

    update = strategy.sharded_update(apply_update)

    def step(state: TrainState, batch: Batch):
        with compiling_for(platform_of(strategy.mesh)):  # kernels for the mesh's devices, not the host's
            return traced_step(state, batch)

    def traced_step(state: TrainState, batch: Batch):
        if scaling and state.loss_scale is None:
            raise ValueError("this policy scales the loss: create the state with "
                             "TrainState(..., loss_scale=policy.loss_scale_state()).")
        scaled = grad_fn if state.loss_scale is None else functools.partial(grad_fn, loss_scale=state.loss_scale.scale)
        model_in = strategy.fetch_params(state.model)  # from host memory if offloaded
        (loss, aux), grads = accumulate(scaled, model_in, batch, accum_steps)
        # The global norm is finite exactly when every gradient is (or their squares overflow fp32,
        # a norm above 1e19): the reduction the metric needs serves the guard too, instead of a
        # finiteness pass over every leaf (8% fewer kernels in a small step; docs/measured/suite_times.md).
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params = eqx.filter(model_in, eqx.is_array)
        old_opt = strategy.fetch_opt_state(state.opt_state)  # from host memory if offloaded
        new_params, new_opt = update(grads, old_opt, params)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        model = strategy.stash_params(
            eqx.combine(keep(new_params, params), eqx.filter(model_in, eqx.is_array, inverse=True)))
        opt_state = strategy.stash_opt_state(keep(new_opt, old_opt))
        skipped = (~finite).astype(jnp.int32)
        loss_scale = None if state.loss_scale is None else state.loss_scale.adjust(finite)
        new_state = TrainState(model, opt_state, state.step + 1, rng=state.rng,
                               skipped=state.skipped + skipped, loss_scale=loss_scale)
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": skipped, **aux}
        if loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        return new_state, metrics

    # Offloaded arrays are not donated: jax 0.10 aborts aliasing a pinned_host input
    # buffer to the step's output, so under offload the step donates nothing.
    donate = donate and strategy.part(Offload) is None
    return TrainStep(eqx.filter_jit(step, donate="all" if donate else "none"), strategy, donate)


class TrainStep:
    """`make_train_step`'s step: `step(state, batch)` and `step.lower(state, batch)` run the jitted step on
    the state as `Strategy.settle` lays it out, the layout the step returns, so that the first call and
    every later one share one program (a fresh state's uncommitted or differently spelled arrays would
    compile a second). `__wrapped__` is the traced body; `donate_first`, whether the state is donated."""

    def __init__(self, jitted: Any, strategy: Strategy, donate: bool):
        self._jitted, self._strategy, self.donate_first = jitted, strategy, donate
        self.__wrapped__ = jitted.__wrapped__

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Array]]:
        return self._jitted(self._strategy.settle(state), batch)

    def lower(self, state: TrainState, batch: Batch) -> Any:
        """The step lowered for `state` and `batch` (`.compile()` gives the program the recipe runs)."""
        return self._jitted.lower(self._strategy.settle(state), batch)


def lower_from_shapes(step_fn: Callable, state: TrainState, batch: Batch) -> jax.stages.Lowered:
    """`step_fn.lower(state, batch)` for a `make_train_step` step whose state and batch may hold
    `jax.ShapeDtypeStruct`s (with shardings) in place of arrays: "will it fit" as a compile, with
    nothing allocated, on any devices (the planner's compile-only TPU devices, `eqgpt.plan`).

    The step's own traced body is lowered, with the same donation; only its `jit` wrapper differs
    (`eqx.filter_jit` would take shapes for static values).
    """
    body = getattr(step_fn, "__wrapped__", step_fn)
    leaf = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    dynamic, static = eqx.partition((state, batch), leaf)

    def run(dynamic):
        return eqx.filter(body(*eqx.combine(dynamic, static)), eqx.is_array)

    donate = (0,) if getattr(step_fn, "donate_first", True) else ()
    return jax.jit(run, donate_argnums=donate).lower(dynamic)
