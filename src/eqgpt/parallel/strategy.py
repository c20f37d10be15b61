"""`Strategy`: one object that describes a parallelism completely.

A strategy is data: a mesh, a rule set (`"dp"`, `"fsdp+tp"`, ...), per-module
`overrides`, and its parts: `Strategy(mesh, "fsdp+tp", parts=(Pipeline("1f1b", 8),
Context("ring")))`. It gives the trainer everything it needs and nothing else:

- a `Placement` (the strategy *is* one): where the model, the optimizer state and
  each batch live;
- `grad_fn(policy)`: `(model, batch) -> ((loss, aux), grads)`, the one place
  where the parallel forms of the loss are chosen;
- `loss_fn()`: the same loss without gradients, for validation.

Each part (`eqgpt.parallel.part.Part`) is a frozen dataclass of its own settings that
answers for itself in its own module; `Strategy` sorts them by their `order` and folds
over them in every method, never asking which ones it has. `strategy.part(Context)`
answers the questions of code outside `parallel/`. The rules alone are the automatic path.

A single device is the same protocol: `Strategy()`. The parameter tree never
changes: context attention swaps the attention *kernel* (`Attention.with_kernel`),
manual tensor parallelism swaps leaf layers inside its `shard_map` only, the
pipeline re-stacks layers inside its program only. So a checkpoint written under
any strategy restores under any other.

Every mesh axis larger than 1 must be used by some part of the strategy, or
`Strategy` raises `ValueError` before anything compiles: a silent replica
repeating the same work is a bug, not a configuration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PRNGKeyArray, PyTree

from eqgpt.data.batch import Batch
from eqgpt.nn.kernels.platform import compiling_for, platform_of
from eqgpt.nn.loss import lm_batch_loss
from eqgpt.nn.protocol import check_language_model
from eqgpt.parallel.auto import _is_array_like, check_divisibility, put
from eqgpt.parallel.part import KINDS, GradFn, LossFn, Part, Update
from eqgpt.parallel.placement import Placement, ShardedPlacement, SingleDevice
from eqgpt.parallel.rules import Rules, preset_rules
from eqgpt.precision import Policy

P = TypeVar("P", bound=Part)

# How to use a mesh axis the rules leave unused (the parts' own axes: `Part.hints`).
RULE_HINTS = {"data": "add 'dp' to --strategy", "fsdp": "add 'fsdp' to --strategy",
              "tensor": "add 'tp' or 'sp' to --strategy"}


# The memory kinds state can live in between steps (`Part.memory_kind`), as spaces inside `jit`.
_SPACES = {"device": jax.memory.Space.Device, "pinned_host": jax.memory.Space.Host}


def _place_in(tree: PyTree, kind: str) -> PyTree:
    """Outside `jit`: each array of `tree` moved to its own sharding's memory `kind`."""
    arrays, static = eqx.partition(tree, _is_array_like)
    return eqx.combine(jax.tree.map(lambda x: put(x, x.sharding.with_memory_kind(kind)), arrays), static)


def _transfer(tree: PyTree, kind: str) -> PyTree:
    """Inside `jit`: the arrays of `tree` copied into memory `kind`."""
    return jax.tree.map(lambda x: jax.device_put(x, _SPACES[kind]) if eqx.is_array(x) else x, tree)


def _first(choices: Iterable[Any], default: Any = None) -> Any:
    """The first choice that is not `None` (parts are asked lazily, in order), else `default`."""
    return next((c for c in choices if c is not None), default)


@dataclass(frozen=True)
class Strategy:
    """A parallelism, described once; also the `Placement` of its model and batches.

    **Fields:**

    - `mesh`: a mesh from `make_mesh`, or `None` for one device.
    - `rules`: a rule set or a preset string (`"dp"`, `"fsdp+tp"`, `"dp+sp"`, ...).
    - `overrides`: per-module rule sets (see `eqgpt.parallel.auto`).
    - `parts`: `eqgpt.parallel.part.Part`s, each a kind of parallelism with its settings:
      `Pipeline`, `Context`, `Expert` (implied whenever the mesh's `expert` axis is > 1),
      `Zero`, `Manual`, `Offload`, `Overlap`, or your own. Kept sorted by their `order`.

    Build from flags with `ParallelFlags.parse("data=2,tensor=2", "dp+tp", ...)` or
    `eqgpt.parallel.ParallelFlags(...).strategy()`.
    """

    mesh: Mesh | None = None
    rules: Rules | str = "dp"
    overrides: Mapping[str, Rules] | None = None
    parts: tuple[Part, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "rules", preset_rules(self.rules))
        given = tuple(self.parts)
        implied = [p for kind in KINDS if not any(isinstance(g, kind) for g in given)
                   and (p := kind.implied(self.mesh)) is not None]
        parts = tuple(sorted((*given, *implied), key=lambda p: p.order))
        object.__setattr__(self, "parts", parts)
        needy = [p.name for p in parts if p.needs_mesh]
        if self.mesh is None and needy:
            example = {"pipeline": "pipeline=2,data=2", "context": "context=2,data=2", "expert": "expert=2,data=2",
                       "manual": "data=2,tensor=2"}.get(needy[0], "data=2")
            raise ValueError(f"{', '.join(needy)} needs a mesh, e.g. --mesh {example}; one device runs none of them.")
        for part in parts:
            part.validate(self)
        object.__setattr__(self, "rules", self._fold("rules", self.rules))
        if self.mesh is not None:
            self._check_axes_used()

    def _check_axes_used(self) -> None:
        unused = [a for a in self.mesh.axis_names if self.mesh.shape[a] > 1 and a not in self.axes_used]
        if not unused:
            return
        hints = {**RULE_HINTS, **{a: h for kind in KINDS for a, h in kind.hints.items()}}
        raise ValueError(
            f"mesh axes {unused} (sizes {[self.mesh.shape[a] for a in unused]}) are used by no part of "
            f"strategy {self.describe()!r}: their devices would repeat the same work. "
            + "; ".join(f"{a}: {hints.get(a, 'use it')}" for a in unused) + ", or drop the axis from --mesh."
        )

    def _fold(self, hook: str, value: Any, *args, **kwargs) -> Any:
        """`value` passed through every part's `hook(self, value, *args, **kwargs)`, in order."""
        for part in self.parts:
            value = getattr(part, hook)(self, value, *args, **kwargs)
        return value

    # ------------------------------------------------------------------ construction

    def part(self, kind: type[P]) -> P | None:
        """The strategy's part of class `kind` (`strategy.part(Pipeline)`), or `None`."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    # ------------------------------------------------------------------ what it uses

    @property
    def axes_used(self) -> tuple[str, ...]:
        """Mesh axes some part of this strategy splits work over."""
        if self.mesh is None:
            return ()
        used = {a for r in (self.rules, *(self.overrides or {}).values())
                for kind in ("params", "activations") for a in r.uses(kind, self.mesh)}
        used = used.union(*(p.axes(self) for p in self.parts))
        return tuple(a for a in self.mesh.axis_names if a in used and self.mesh.shape[a] > 1)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the rules split the residual stream's sequence over `tensor` (`sp`)."""
        return "tensor" in self.rules.axes("seq", "activations")

    def describe(self) -> str:
        """A one-line label: `fsdp+tp | pipeline 1f1b m=8 | context ring | manual`."""
        pieces = [d for p in self.parts if (d := p.describe(self)) is not None]
        return " | ".join(["single device" if self.mesh is None else self.rules.name, *pieces])

    def notes(self, model_like: PyTree, batch_shape: tuple[int, int]) -> list[str]:
        """Lines for a run's log: what each part will do with the model and a step's `(rows, seq)`."""
        return [line for p in self.parts for line in p.notes(self, model_like, batch_shape)]

    def __repr__(self) -> str:
        mesh = "one device" if self.mesh is None else ",".join(f"{a}={n}" for a, n in self.mesh.shape.items() if n > 1)
        return f"Strategy({mesh or 'one device'}: {self.describe()})"

    # ------------------------------------------------------------------ placement

    def placement_for(self, model_like: PyTree) -> Placement:
        """The placement of `model_like` (a model or its `eqx.filter_eval_shape`)."""
        if self.mesh is None:
            return SingleDevice()
        placement = _first(p.placement(self, model_like) for p in self.parts)
        return ShardedPlacement(self.mesh, self.param_rules, self.overrides) if placement is None else placement

    @property
    def param_rules(self) -> Rules:
        """The rules parameters are placed by: `rules`, and under a pipeline `layers` over `pipeline`."""
        return self._fold("param_rules", self.rules)

    def _batch_rules(self) -> Rules:
        return _first((p.batch_rules(self) for p in self.parts), self.rules)

    @property
    def batch_divisor(self) -> int:
        """Pieces the batch's rows are split into by the placement (not counting microbatches)."""
        if self.mesh is None:
            return 1
        axes = {*self.rules.axes("batch", "activations"), *self._batch_rules().axes("batch", "activations")}
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def _microbatches(self) -> int:
        return math.prod(p.microbatches for p in self.parts if p.microbatches is not None)

    @property
    def rows_divisor(self) -> int:
        """What the global batch size must be a multiple of (devices x pipeline microbatches)."""
        return self.batch_divisor * self._microbatches

    def prepare(self, model: PyTree) -> PyTree:
        """Install what the strategy needs into the model (context kernels; with
        `offload_params` its arrays move to host memory)."""
        return self._move(self._fold("prepare", model), "params", _place_in)

    def init_model(self, make: Callable[[PRNGKeyArray], PyTree], key: PRNGKeyArray) -> PyTree:
        """`make(key)`, created directly in its sharding, with the strategy's kernels installed."""
        abstract = jax.eval_shape(make, key) if any(p.needs_shapes for p in self.parts) else None
        return self.prepare(self.placement_for(abstract).init_model(make, key))

    def place_model(self, model: PyTree) -> PyTree:
        """An existing model (any placement, any strategy's kernels) moved into this strategy's layout."""
        for kind in KINDS:  # what any strategy installed, whichever placed the model
            model = kind.unprepare(model)
        return self.prepare(self.placement_for(model).place_model(model))

    def init_opt_state(self, optimizer: Any, model: PyTree) -> PyTree:
        """The optimizer state, each moment created next to its parameter (in host memory
        with `offload_opt_state`)."""
        model = self.on_device(model)  # created from device copies, whatever `offload_params`
        return self._move(self.placement_for(model).init_opt_state(optimizer, model), "opt_state", _place_in)

    def place_opt_state(self, opt_state: PyTree, model: PyTree) -> PyTree:
        """An existing optimizer state moved next to its parameters."""
        model = self.on_device(model)
        return self._move(self.placement_for(model).place_opt_state(opt_state, model), "opt_state", _place_in)

    def _move(self, tree: PyTree, what: str, move: Callable, to: str | None = None) -> PyTree:
        """`tree` (the strategy's `what`) moved by `move` into memory `to`, or else where a part keeps
        it between steps (`Part.memory_kind`); unchanged where no part keeps it off the device."""
        kind = _first(p.memory_kind(self, what) for p in self.parts)
        return tree if kind is None else move(tree, to or kind)

    def fetch_opt_state(self, opt_state: PyTree) -> PyTree:
        """Inside the step: the optimizer state where the update reads it (device memory)."""
        return self._move(opt_state, "opt_state", _transfer, "device")

    def stash_opt_state(self, opt_state: PyTree) -> PyTree:
        """Inside the step: the updated optimizer state where it lives between steps."""
        return self._move(opt_state, "opt_state", _transfer)

    def fetch_params(self, model: PyTree) -> PyTree:
        """Inside a compiled function: the model with its arrays in device memory."""
        return self._move(model, "params", _transfer, "device")

    def stash_params(self, model: PyTree) -> PyTree:
        """Inside the step: the updated model where it lives between steps."""
        return self._move(model, "params", _transfer)

    def on_device(self, model: PyTree) -> PyTree:
        """Outside `jit`: the model with its arrays in device memory (to sample from or export)."""
        return self._move(model, "params", _place_in, "device")

    def settle(self, tree: PyTree) -> PyTree:
        """Outside `jit`: `tree`'s arrays laid out as a compiled step returns them, so that one program serves
        the first step and every later one. Uncommitted arrays (a fresh key, a step counter) are committed:
        replicated over the mesh, or where they are; a `NamedSharding` is spelled without trailing `None`s.
        Arrays already so laid out are returned as they are; so is the whole tree when the mesh spans
        several processes (`device_put` cannot commit a process's local array to it)."""
        whole = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        if whole is not None and not whole.is_fully_addressable:
            return tree

        def one(x):
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                return x
            if not x.committed:
                return jax.device_put(x, whole or x.sharding)
            s = x.sharding
            if isinstance(s, NamedSharding) and s.spec and s.spec[-1] is None:
                spec = list(s.spec)
                while spec and spec[-1] is None:
                    spec.pop()
                return jax.device_put(x, NamedSharding(s.mesh, PartitionSpec(*spec), memory_kind=s.memory_kind))
            return x

        return jax.tree.map(one, tree)

    def batch(self, local: PyTree) -> PyTree:
        """Global arrays from this process's rows (a `Batch`): rows split as the strategy's loss expects."""
        if self.mesh is None:
            return SingleDevice().batch(local)
        return ShardedPlacement(self.mesh, self._batch_rules()).batch(local)

    # ------------------------------------------------------------------ checks

    def check(self, model_like: PyTree, *, batch_size: int, seq_len: int, accum_steps: int = 1) -> None:
        """Raise `ValueError`, before anything compiles, for sizes this strategy cannot split.

        **Arguments:** the model (or its `eqx.filter_eval_shape`), the global
        `batch_size` and `seq_len` of a training step, and `accum_steps`. The model must
        be an `eqgpt.nn.LanguageModel` (the error names the members it lacks).
        """
        check_language_model(model_like)
        if accum_steps < 1 or batch_size % accum_steps:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by accum_steps ({accum_steps}).")
        rows = batch_size // accum_steps
        if self.mesh is not None:
            self._check_rows(model_like, rows, seq_len, accum_steps)
        for part in self.parts:
            part.check(self, model_like, rows=rows, seq_len=seq_len)

    def _check_rows(self, model_like: PyTree, rows: int, seq_len: int, accum_steps: int) -> None:
        if rows % self.rows_divisor:
            micro = "".join(f" x {p.microbatches} microbatches" for p in self.parts if p.microbatches is not None)
            raise ValueError(
                f"batch of {rows} rows per step{' (after accumulation)' if accum_steps > 1 else ''} is not "
                f"divisible by {self.batch_divisor} data-parallel devices{micro} = {self.rows_divisor}; "
                f"use a --batch-size that is a multiple of {self.rows_divisor * accum_steps}."
            )
        if all(p.automatic for p in self.parts):  # the rules lay out every part's work
            check_divisibility(model_like, self.mesh, self.rules, rows // self._microbatches, seq_len, self.overrides)

    # ------------------------------------------------------------------ the loss

    def loss_fn(self, *, chunk_size: int = 128, z_loss: float = 0.0, model_like: PyTree = None) -> LossFn:
        """`loss_fn(model, batch) -> (loss, aux)` in this strategy's layout (validation; no gradients).

        `model_like` (the model or its `eqx.filter_eval_shape`) is needed by the manual path only.
        It reads the model where it lives between steps (`fetch_params`: host memory
        with `offload_params`).
        """
        loss = self._loss(chunk_size, z_loss, model_like)

        def stored_loss(model: PyTree, batch: Batch):
            return loss(self.fetch_params(model), batch)

        return stored_loss

    def _loss(self, chunk_size: int, z_loss: float, model_like: PyTree) -> LossFn:
        """The loss of a model in device memory: the automatic path's, as each part changes it.
        (Validation of a pipelined model needs no pipeline: the partitioner runs the layers
        where the pipeline placed them.)"""

        def loss(model: PyTree, batch: Batch):
            return lm_batch_loss(model, batch, chunk_size=chunk_size, z_loss=z_loss)

        loss = self._fold("loss_fn", loss, chunk_size=chunk_size, z_loss=z_loss, model_like=model_like)
        return loss if self.mesh is None else self._on_mesh(loss)

    def _on_mesh(self, fn: Callable) -> Callable:
        """`fn` traced with this mesh as the ambient (abstract) mesh, so that what cannot be partitioned
        automatically (a Pallas kernel: `eqgpt.nn.kernels.mesh`) can map itself over its axes."""

        def on_mesh(*args, **kwargs):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), compiling_for(platform_of(self.mesh)):
                return fn(*args, **kwargs)

        return on_mesh

    def grad_fn(
        self, policy: Policy | None = None, *, chunk_size: int = 128, z_loss: float = 0.0, model_like: PyTree = None
    ) -> GradFn:
        """`grad_fn(model, batch) -> ((loss, aux), grads)` of this strategy, computing in `policy`.

        Loss and aux are fp32, gradients in the parameter dtype with the model's
        structure, already reduced over every axis the strategy splits the batch over.
        The first part with a gradient function of its own decides; else the policy's
        gradient of the loss.
        """
        policy = Policy() if policy is None else policy
        grad = _first(p.grad_fn(self, policy, chunk_size=chunk_size, z_loss=z_loss, model_like=model_like)
                      for p in self.parts)
        return policy.value_and_grad(self._loss(chunk_size, z_loss, model_like)) if grad is None else grad

    def sharded_update(self, update: Update) -> Update:
        """The optimizer update `update(grads, opt_state, params) -> (params, opt_state)` as this
        strategy runs it: unchanged, or under ZeRO on each device's block (`eqgpt.parallel.zero`)."""
        return self._fold("update", update)


__all__ = ["Strategy", "Part", "GradFn", "LossFn", "lm_batch_loss"]
