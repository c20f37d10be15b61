"""`make_train_step`: loss and gradients (with accumulation), a guard, the update.

The step is one compiled function `state, batch -> state, metrics` whose state
buffers are donated, so the old and the new state never coexist in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int, PyTree

from eqgpt.nn.loss import lm_loss
from eqgpt.precision import Policy
from eqgpt.train.state import TrainState

GradFn = Callable[[PyTree, Array], tuple[tuple[Array, dict], PyTree]]


def batch_loss(model: PyTree, batch: Int[Array, "batch seq_plus_one"]) -> tuple[Array, dict]:
    """`lm_loss` of `model` on a `[batch, seq + 1]` token array (inputs, shifted targets)."""
    return lm_loss(model, batch[:, :-1], batch[:, 1:])


def make_grad_fn(loss_fn: Callable = batch_loss, policy: Policy | None = None) -> GradFn:
    """`grad_fn(model, batch) -> ((loss, aux), grads)` differentiating `loss_fn`.

    The model is cast to `policy.compute_dtype` inside the differentiated function,
    so gradients come back in the parameter dtype; the loss is cast to fp32.
    """

    policy = Policy() if policy is None else policy

    def loss_of(model, batch):
        loss, aux = loss_fn(policy.cast_to_compute(model), batch)
        return loss.astype(jnp.float32), jax.tree.map(lambda a: a.astype(jnp.float32), aux)

    def grad_fn(model, batch):
        return eqx.filter_value_and_grad(loss_of, has_aux=True)(model, batch)

    return grad_fn


def accumulate(grad_fn: GradFn, model: PyTree, batch: Array, accum_steps: int):
    """Mean loss, aux and gradients over `accum_steps` microbatches, with `jax.lax.scan`.

    The batch's leading dimension is split into `[accum_steps, batch / accum_steps]`;
    sums are kept in fp32. Equal to one step on the whole batch when the loss is a
    mean over equally many tokens per microbatch (as `lm_loss` without a mask).
    """
    if accum_steps == 1:
        return grad_fn(model, batch)
    if batch.shape[0] % accum_steps:
        raise ValueError(
            f"batch of {batch.shape[0]} rows cannot be split into {accum_steps} microbatches; "
            f"use a batch size divisible by accum_steps."
        )
    micro = batch.reshape(accum_steps, batch.shape[0] // accum_steps, *batch.shape[1:])
    (loss0, aux0), grads0 = jax.eval_shape(grad_fn, model, micro[0])
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), t)  # noqa: E731
    carry0 = (zeros(loss0), zeros(aux0), zeros(grads0))

    def body(carry, mb):
        (loss, aux), grads = grad_fn(model, mb)
        add = lambda a, b: jax.tree.map(lambda x, y: x + y.astype(jnp.float32), a, b)  # noqa: E731
        return (add(carry[0], loss), add(carry[1], aux), add(carry[2], grads)), None

    (loss, aux, grads), _ = jax.lax.scan(body, carry0, micro)
    mean = lambda t, like: jax.tree.map(lambda x, s: (x / accum_steps).astype(s.dtype), t, like)  # noqa: E731
    return (mean(loss, loss0), mean(aux, aux0)), mean(grads, grads0)


def all_finite(tree: PyTree) -> Array:
    """Whether every floating element of `tree` is finite (a scalar bool)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    grad_fn: GradFn | None = None,
    accum_steps: int = 1,
    policy: Policy | None = None,
    donate: bool = True,
) -> Callable[[TrainState, Array], tuple[TrainState, dict[str, Array]]]:
    """A compiled training step.

    **Arguments:**

    - `optimizer`: an optax transformation over `eqx.filter(model, eqx.is_array)`.
    - `grad_fn`: `(model, batch) -> ((loss, aux), grads)`; default `make_grad_fn(policy=policy)`
      (`lm_loss` on `[batch, seq + 1]` tokens). Pipeline, manual tensor and context
      parallelism bring their own.
    - `accum_steps`: microbatches per step, accumulated with `jax.lax.scan`.
    - `policy`: the mixed-precision `Policy` of the default `grad_fn`.
    - `donate`: donate the state's buffers (the caller must not reuse the old state).

    **Returns:** `step(state, batch) -> (state, metrics)` with metrics `loss`,
    `grad_norm`, `skipped` (1 if this update was dropped) and the aux entries. If
    the loss or any gradient is not finite, model and optimizer state are left
    unchanged, `state.skipped` grows by one and `state.step` still advances.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}.")
    grad_fn = make_grad_fn(policy=policy) if grad_fn is None else grad_fn

    def step(state: TrainState, batch: Array):
        (loss, aux), grads = accumulate(grad_fn, state.model, batch, accum_steps)
        finite = jnp.isfinite(loss) & all_finite(grads)
        params = eqx.filter(state.model, eqx.is_array)
        updates, new_opt = optimizer.update(grads, state.opt_state, params)
        new_model = eqx.apply_updates(state.model, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        model = eqx.combine(keep(eqx.filter(new_model, eqx.is_array), params),
                            eqx.filter(state.model, eqx.is_array, inverse=True))
        opt_state = keep(new_opt, state.opt_state)
        skipped = (~finite).astype(jnp.int32)
        new_state = TrainState(model, opt_state, state.step + 1, rng=state.rng,
                               skipped=state.skipped + skipped)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "skipped": skipped, **aux}
        return new_state, metrics

    return eqx.filter_jit(step, donate="all" if donate else "none")
