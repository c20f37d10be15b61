"""AdamW with linear warmup and cosine decay (extended without a jump when a run trains past its
end), a decay mask, and global-norm clipping.

The weight-decay mask comes from the module structure: `Linear` weights decay;
biases, norm scales and embedding tables do not (unless asked). Arrays of other
modules decay when their logical axes (`eqgpt.nn.logical_axes`) name two or more
dimensions besides `layers`, i.e. when they are matrices.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from eqgpt.nn.axes import LogicalAxes, logical_axes
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.linear import Linear
from eqgpt.nn.norm import LayerNorm, RMSNorm
from eqgpt.precision import dtype_of


def decay_mask(params: PyTree, *, embeddings: bool = False, norms_and_biases: bool = False) -> PyTree:
    """`True` for every array of `params` that weight decay applies to.

    **Arguments:** `params` (a model, or `eqx.filter(model, eqx.is_array)`);
    `embeddings`, `norms_and_biases`: also decay those.

    **Returns:** a tree like `params` with bools in place of arrays.
    """

    def flags(module):
        if isinstance(module, Embedding):
            return jax.tree.map(lambda _: embeddings, module)
        if isinstance(module, (LayerNorm, RMSNorm)):
            return jax.tree.map(lambda _: norms_and_biases, module)
        if isinstance(module, Linear):
            out = eqx.tree_at(lambda m: m.weight, module, True)
            if module.bias is not None:
                out = eqx.tree_at(lambda m: m.bias, out, norms_and_biases)
            return out
        return module

    known = lambda x: isinstance(x, (Embedding, LayerNorm, RMSNorm, Linear))  # noqa: E731
    marked = jax.tree.map(flags, params, is_leaf=known)
    axes = logical_axes(params)

    def by_axes(flag, names):
        if isinstance(flag, bool):
            return flag
        if isinstance(names, LogicalAxes):
            return sum(n != "layers" for n in names.names) >= 2 or norms_and_biases
        return False

    return jax.tree.map(by_axes, marked, axes, is_leaf=lambda x: isinstance(x, (bool, LogicalAxes)))


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all of `tree`'s arrays, summed in fp32."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.float32(0.0)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (same state, same scaling) with an explicit norm.

    The norm is `global_norm` (fp32), or the `norm_fn(tree) -> scalar` given to `update`
    as an optax extra argument (`optax.chain` passes it on). The manual ZeRO update
    gives one that sums the squares of its blocks over `data` (`eqgpt.parallel.zero.block_norm`).
    optax's own clipping takes no norm function and sums in the gradients' dtype.
    """

    def update(updates, state, params=None, *, norm_fn=None, **extra_args):
        del params, extra_args
        norm = (global_norm if norm_fn is None else norm_fn)(updates)
        trigger = norm < max_norm
        return jax.tree.map(lambda t: jnp.where(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_lr_schedule(
    lr: float, *, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine to `min_lr_ratio * lr`."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be positive, got {total_steps}.")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must lie in [0, total_steps={total_steps}).")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=lr * min_lr_ratio,
    )


TAILS = ("cosine", "linear", "constant")  # how `extend_schedule` continues a schedule past its end


def extend_schedule(schedule: optax.Schedule, *, start: int, end: int, final: float,
                    tail: str = "cosine") -> optax.Schedule:
    """`schedule` before step `start`; from `start` to `end`, a `tail` from its rate at `start`, so the rate
    never jumps: `"cosine"` (half a cosine down to `final` at `end`), `"linear"` (a line down to `final`),
    `"constant"` (the rate at `start` throughout). After `end`: the tail's last rate.

    What a resumed run that trains past its schedule's end follows (`--resume --steps N`, `--optim.extend`).
    """
    if tail not in TAILS:
        raise ValueError(f"schedule tail must be one of {', '.join(TAILS)}, got {tail!r}.")
    if end <= start:
        raise ValueError(f"a schedule tail must end after it starts, got start={start}, end={end}.")
    rate = float(schedule(start))

    def extended(count):
        t = jnp.clip((count - start) / (end - start), 0.0, 1.0)
        if tail == "cosine":
            new = final + (rate - final) * 0.5 * (1 + jnp.cos(jnp.pi * t))
        elif tail == "linear":
            new = rate + (final - rate) * t
        else:
            new = jnp.full_like(t, rate)
        return jnp.where(count < start, schedule(count), new)

    return extended


def make_optimizer(
    schedule: optax.Schedule | float,
    *,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    clip_norm: float | None = 1.0,
    decay_embeddings: bool = False,
    decay_norms_and_biases: bool = False,
    mu_dtype: str | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the decay mask of `decay_mask`.

    **Arguments:** a learning-rate `schedule` (or constant), AdamW's `weight_decay`,
    `b1`, `b2`, `eps`; `clip_norm` (`None` disables clipping); which arrays decay;
    `mu_dtype` ("bf16", "fp32" or `None`: the parameters' dtype), the dtype AdamW
    keeps its first moment in (bf16 halves it; the second moment stays in the
    parameters' dtype, as `optax.adamw` keeps it).

    **Returns:** an `optax.GradientTransformation` for `eqx.filter(model, eqx.is_array)`.
    """
    mask = lambda p: decay_mask(p, embeddings=decay_embeddings, norms_and_biases=decay_norms_and_biases)  # noqa: E731
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask,
                        mu_dtype=None if mu_dtype is None else dtype_of(mu_dtype))
    return adamw if clip_norm is None else optax.chain(clip_by_global_norm(clip_norm), adamw)
