"""Mixed precision: parameters in one dtype, compute in another.

Every strategy applies the same `Policy` (see `eqgpt.parallel.Strategy.grad_fn`).

Parameters stay fp32 (the optimizer updates them). The loss function casts a copy
to `compute_dtype` *inside* the differentiated function, so gradients arrive in the
parameter dtype. Losses, softmax statistics and gradient sums stay fp32 whatever
the compute dtype (`eqgpt.nn.lm_loss` computes in fp32).

Two more modes (see `docs/numerics.md`):

- **fp16 with dynamic loss scaling** (`Policy.named("fp16")`): the loss is multiplied
  by a scale before differentiation and the gradients divided by it after, in fp32;
  the scale (a `LossScale` in the `TrainState`, so checkpoints keep it) halves on a
  step whose gradients overflow (the step is skipped) and doubles after
  `growth_interval` good steps in a row.
- **low-precision parameters with fp32 master weights** (`master_weights=True`):
  the model's arrays are stored in `param_dtype` (bf16), and the optimizer
  (`Policy.optimizer`, `with_master_weights`) keeps an fp32 copy that it updates;
  the stored parameters are that copy rounded.

And int8 matmuls (`Policy.named("int8")`, `--precision int8`): bf16 compute, with the
projection and MLP `Linear` layers run as int8 x int8 products accumulated in int32
(`eqgpt.nn.quant`). The layers are marked inside the differentiated function
(`compute_model`), so the stored model, its gradients and its checkpoints stay float,
and a run can change precision when it resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PyTree

from eqgpt.nn.linear import Linear
from eqgpt.nn.quant import INT8_BACKWARDS, Int8

_DTYPES = {"fp32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16,
           "bfloat16": jnp.bfloat16, "fp16": jnp.float16, "float16": jnp.float16}


def dtype_of(name: str) -> jnp.dtype:
    """The dtype of a precision name ("fp32", "bf16", "fp16" or their long forms)."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}.")
    return jnp.dtype(_DTYPES[name])


def _cast(tree: PyTree, dtype) -> PyTree:
    return jax.tree.map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        tree,
    )


class LossScale(eqx.Module):
    """The dynamic loss scale: its value and the count of finite steps since it last changed.

    **Fields:** `scale` (fp32 scalar), `good_steps` (int32 scalar); static
    `growth_interval` (good steps before the scale doubles) and `factor` (2).
    """

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]
    growth_interval: int = eqx.field(static=True, default=2000)
    factor: float = eqx.field(static=True, default=2.0)

    def adjust(self, finite: Bool[Array, ""]) -> LossScale:
        """After a step: halve (not below 1) if the gradients overflowed, double after
        `growth_interval` finite steps in a row, else count one more good step."""
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, self.scale * self.factor, self.scale),
                          jnp.maximum(self.scale / self.factor, 1.0))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32), self.growth_interval, self.factor)


class MasterWeightsState(NamedTuple):
    """`with_master_weights`' state: the fp32 copy of the parameters and the inner optimizer's state."""

    master: PyTree
    inner: optax.OptState


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on an fp32 copy of low-precision parameters (mixed-precision master weights).

    `init(params)` keeps `params` cast to fp32 as `master`; `update(grads, state, params)`
    gives `inner` the fp32 gradients and the master copy, updates the copy in fp32, and
    returns fp32 updates `master - p` that bring `params` to the copy rounded to their
    dtype (`optax.apply_updates`, as `make_train_step` applies them, adds in fp32 and
    rounds once). Small updates that would vanish in bf16 accumulate in the master
    copy instead.
    """
    to32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) if _is_float(x) else x, t)  # noqa: E731

    def init(params):
        master = to32(params)
        return MasterWeightsState(master, inner.init(master))

    inner = optax.with_extra_args_support(inner)

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("with_master_weights needs params in update (make_train_step passes them).")
        updates, inner_state = inner.update(to32(grads), state.inner, state.master, **extra_args)
        master = optax.apply_updates(state.master, updates)
        out = jax.tree.map(lambda m, p: m - p.astype(jnp.float32) if _is_float(p) else None, master, params)
        return out, MasterWeightsState(master, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def scale_value(loss_scale) -> Float[Array, ""]:
    """The loss scale as the fp32 scalar a gradient function multiplies the loss by (1 for `None`)."""
    return jnp.float32(1.0) if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)


def unscale(grads: PyTree, loss_scale) -> PyTree:
    """`grads / loss_scale`, each computed in fp32 and returned in its own dtype.

    Every strategy's gradient function calls it after differentiating `loss * loss_scale`."""
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / loss_scale).astype(g.dtype) if _is_float(g) else g, grads)


def _is_float(x) -> bool:
    return eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


@dataclass(frozen=True)
class Policy:
    """**Fields:**

    - `param_dtype`, `compute_dtype` (names: "fp32", "bf16", "fp16");
    - `loss_scaling`: dynamic loss scaling (for fp16 compute), starting at
      `initial_scale` and doubling after `growth_interval` finite steps;
    - `master_weights`: the optimizer keeps fp32 master weights of `param_dtype`
      parameters (`Policy.optimizer`);
    - `matmul`: `"float"` (in the compute dtype) or `"int8"`: every `Linear` but the
      output head multiplies through int8 (`eqgpt.nn.quant`), with the backward
      `int8_backward` (`"qat"`: straight-through float products; `"qt"`: int8 too).
    """

    param_dtype: str = "fp32"
    compute_dtype: str = "fp32"
    loss_scaling: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    master_weights: bool = False
    matmul: str = "float"
    int8_backward: str = "qat"

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ValueError(f"Policy.{f} = {getattr(self, f)!r}; choose one of {sorted(_DTYPES)}.")
        if self.matmul not in ("float", "int8"):
            raise ValueError(f"Policy.matmul = {self.matmul!r}; choose 'float' or 'int8'.")
        if self.int8_backward not in INT8_BACKWARDS:
            raise ValueError(f"Policy.int8_backward = {self.int8_backward!r}; choose one of {INT8_BACKWARDS}.")
        if self.growth_interval < 1 or self.initial_scale < 1:
            raise ValueError(f"Policy: growth_interval and initial_scale must be >= 1, got {self}.")

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating arrays of `tree` in the parameter dtype (what the model is stored in)."""
        return _cast(tree, _DTYPES[self.param_dtype])

    def optimizer(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """`optimizer`, wrapped by `with_master_weights` when the policy keeps master weights."""
        return with_master_weights(optimizer) if self.master_weights else optimizer

    def loss_scale_state(self) -> LossScale | None:
        """The initial `LossScale` for `TrainState(..., loss_scale=)`; `None` without loss scaling."""
        if not self.loss_scaling:
            return None
        return LossScale(jnp.asarray(self.initial_scale, jnp.float32), jnp.asarray(0, jnp.int32),
                         self.growth_interval)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating arrays of `tree` in the compute dtype (a copy for the forward pass)."""
        return _cast(tree, _DTYPES[self.compute_dtype])

    def compute_model(self, model: PyTree) -> PyTree:
        """The model a loss computes with: `cast_to_compute`, and with `matmul="int8"` every
        `Linear` but the output head (axes naming `vocab`) marked to multiply through int8.
        Call it on a whole model (its static parts included) inside the differentiated function."""
        model = self.cast_to_compute(model)
        if self.matmul == "float":
            return model
        quant = Int8(self.int8_backward)
        mark = lambda m: m.with_quant(quant) if isinstance(m, Linear) and "vocab" not in m.axes else m  # noqa: E731
        return jax.tree.map(mark, model, is_leaf=lambda m: isinstance(m, Linear))

    def value_and_grad(self, loss_fn: Callable) -> Callable:
        """`grad_fn(model, batch) -> ((loss, aux), grads)` of `loss_fn(model, batch) -> (loss, aux)`.

        The model is cast to the compute dtype (`compute_model`) inside the differentiated function,
        so gradients come back in the parameter dtype; loss and aux are cast to fp32.
        The returned function also takes `loss_scale=` (an fp32 scalar): the loss is
        multiplied by it before differentiation and the gradients divided by it
        after, in fp32 (the loss and aux returned are unscaled).
        """

        def loss_of(model, batch, scale):
            loss, aux = loss_fn(self.compute_model(model), batch)
            loss = loss.astype(jnp.float32)
            return loss * scale, (loss, jax.tree.map(lambda a: a.astype(jnp.float32), aux))

        grad = eqx.filter_value_and_grad(loss_of, has_aux=True)

        def grad_fn(model, batch, loss_scale=None):
            scale = scale_value(loss_scale)
            (_, (loss, aux)), grads = grad(model, batch, scale)
            return (loss, aux), grads if loss_scale is None else unscale(grads, scale)

        return grad_fn

    @property
    def compute(self) -> jnp.dtype:
        """The compute dtype as a NumPy dtype."""
        return jnp.dtype(_DTYPES[self.compute_dtype])

    @classmethod
    def named(cls, name: str, *, master_weights: bool = False, int8_backward: str = "qat") -> Policy:
        """`"fp32"`: everything fp32. `"bf16"`: fp32 params and outputs, bf16 compute.
        `"fp16"`: fp16 compute with dynamic loss scaling. `"int8"`: bf16 compute with the
        projection and MLP matmuls through int8 (backward `int8_backward`).

        `master_weights=True` stores the parameters in the compute dtype too, with
        fp32 master weights in the optimizer (not for fp32).
        """
        if name in ("fp32", "float32"):
            if master_weights:
                raise ValueError("master_weights keeps fp32 copies of low-precision parameters; "
                                 "use it with bf16 or fp16, not fp32.")
            return cls()
        low = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "int8": "bf16"}.get(name)
        if low is None:
            raise ValueError(f"Unknown precision {name!r}; choose 'fp32', 'bf16', 'fp16' or 'int8'.")
        return cls(param_dtype=low if master_weights else "fp32", compute_dtype=low, loss_scaling=low == "fp16",
                   master_weights=master_weights, matmul="int8" if name == "int8" else "float",
                   int8_backward=int8_backward)

    @classmethod
    def default(cls, platform: str | None = None) -> Policy:
        """fp32 on CPU (bf16 is emulated there and slower); bf16 compute on GPU/TPU."""
        platform = jax.default_backend() if platform is None else platform
        return cls() if platform == "cpu" else cls(compute_dtype="bf16")
