"""`Part`: one kind of parallelism, as a `Strategy` ingredient that answers for itself.

A `Strategy` is a mesh, a rule set and a tuple of parts (`Strategy.parts`): the
pipeline, context parallelism, ZeRO, the manual path, host offload. A part is a
frozen dataclass of its own settings (`Pipeline("1f1b", microbatches=8)`). Every
method of `Strategy` folds over its parts in `order` and asks each the same
questions; none asks which parts it has. A part's decisions (its axes, its checks,
its placement, its loss) live in its own module, next to the parallelism itself:
`pipeline/part.py`, `context/part.py`, `expert.py`, `zero.py`, `manual.py`,
`offload.py`, `overlap.py`. No part module imports another: parts ask each other
through the class attributes below (`automatic`, `runs_layers`, `sequence_axis`).

Each method below is a no-op by default, so a part overrides only what it changes.
Two kinds of hook:

- **transforms** (`rules`, `param_rules`, `prepare`, `loss_fn`, `update`): each
  part receives what the parts before it made and returns it, changed or not;
- **choices** (`placement`, `batch_rules`, `grad_fn`, `memory_kind`): the first part
  that returns something other than `None` decides; without one, the automatic path's.

Every method takes the `Strategy` first (its mesh, rules and the other parts):
parts are built before the strategy's rules are final.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from jaxtyping import Array, PyTree

from eqgpt.data.batch import Batch
from eqgpt.parallel.placement import Placement
from eqgpt.parallel.rules import Rules
from eqgpt.precision import Policy

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

LossFn = Callable[[PyTree, Batch], tuple[Array, dict[str, Array]]]
GradFn = Callable[[PyTree, Batch], tuple[tuple[Array, dict[str, Array]], PyTree]]
Update = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]

#: Every `Part` class defined so far (their `hints` and `implied` parts), in definition order.
KINDS: list[type[Part]] = []


@dataclass(frozen=True)
class Part:
    """One ingredient of a `Strategy`; subclass and override what the ingredient changes.

    **Class attributes:**

    - `name`: how errors name the part (`"pipeline needs a mesh"`).
    - `order`: where `Strategy` folds it (lower first); parts of your own default to 100.
    - `needs_mesh`: whether one device cannot run it (`Strategy` raises `ValueError`).
    - `hints`: mesh axis -> how to use it, shown when that axis is left unused. Read
      from the part's *class* (`KINDS`), so a strategy without the part still gives the hint.
    - `automatic`: whether the partitioner lays out the part's work by the rules
      (so `check` tests the rules' divisibility); the manual path does it itself.
    - `on_manual_path`: whether it composes with a part that is not `automatic`.
    - `runs_layers`: whether it runs the layer stack itself (a pipeline's stages).
    - `needs_shapes`: whether `placement` reads the model's shapes, so that
      `Strategy.init_model` computes them first (`jax.eval_shape` of `make`).
    - `switch`: the setting that turns the part on from flags (`--pipeline 1f1b`),
      or `None` (`--manual`); see `eqgpt.parallel.flags`.
    """

    name: ClassVar[str] = "part"
    order: ClassVar[int] = 100
    needs_mesh: ClassVar[bool] = True
    hints: ClassVar[Mapping[str, str]] = {}
    automatic: ClassVar[bool] = True
    on_manual_path: ClassVar[bool] = True
    runs_layers: ClassVar[bool] = False
    needs_shapes: ClassVar[bool] = False
    switch: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        KINDS.append(cls)

    @classmethod
    def implied(cls, mesh: Any) -> Part | None:
        """The part a strategy on `mesh` holds when none of this kind is given, or `None`."""
        return None

    @property
    def microbatches(self) -> int | None:
        """What the rows of a step are split into in turn (a pipeline's microbatches), or `None`."""
        return None

    @property
    def sequence_axis(self) -> str | None:
        """The mesh axis the part splits the sequence over, or `None`."""
        return None

    # ------------------------------------------------------------------ construction

    def axes(self, strategy: Strategy) -> set[str]:
        """Mesh axes the part splits work over beyond those of the rules."""
        return set()

    def validate(self, strategy: Strategy) -> None:
        """Raise `ValueError` at construction for combinations the part cannot run."""

    def rules(self, strategy: Strategy, rules: Rules) -> Rules:
        """The strategy's rule set as this part needs it (applied once, at construction)."""
        return rules

    def param_rules(self, strategy: Strategy, rules: Rules) -> Rules:
        """The rules parameters are placed by."""
        return rules

    def describe(self, strategy: Strategy) -> str | None:
        """The part's piece of `Strategy.describe()`, or `None`."""
        return None

    def notes(self, strategy: Strategy, model_like: PyTree, batch_shape: tuple[int, int]) -> list[str]:
        """Lines for a run's log before it trains (`Strategy.notes`): what the part will do."""
        return []

    def before_backend(self) -> None:
        """What must happen before JAX starts a backend (XLA reads its flags then)."""

    # ------------------------------------------------------------------ placement

    def placement(self, strategy: Strategy, model_like: PyTree) -> Placement | None:
        """A placement of its own (choice), or `None`."""
        return None

    def batch_rules(self, strategy: Strategy) -> Rules | None:
        """The rules batches are split by (choice), or `None`; their `batch` axes also
        count in `Strategy.batch_divisor`."""
        return None

    def prepare(self, strategy: Strategy, model: PyTree) -> PyTree:
        """The placed model with what the part installs (kernels; host memory)."""
        return model

    @classmethod
    def unprepare(cls, model: PyTree) -> PyTree:
        """`model` without what a part of this kind installs (any strategy's): `Strategy.place_model`
        applies every kind's (`KINDS`) before placing a model, so it needs to know none."""
        return model

    def split_sequence_in_stages(self, mesh: Any, model: PyTree,
                                 fields: dict[str, Array]) -> tuple[PyTree, dict[str, Array], Array]:
        """For a part that runs the layers itself inside its own manual region (a pipeline's
        stages): `(model, fields, positions)` with the sequence split over `sequence_axis` as
        this part splits it (the batch's fields laid out, the attention kernels swapped; the
        same arrays). Only parts with a `sequence_axis` are asked."""
        raise ValueError(f"{self.name} splits no sequence: only a part with a sequence_axis lays out "
                         "a pipeline stage's batch.")

    def memory_kind(self, strategy: Strategy, what: Literal["params", "opt_state"]) -> str | None:
        """The memory kind `what` lives in between steps (choice; e.g. `"pinned_host"`), or `None`:
        device memory. `Strategy` moves it there and, for each step, to the device and back."""
        return None

    # ------------------------------------------------------------------ checks

    def check(self, strategy: Strategy, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        """Raise `ValueError`, before anything compiles, for sizes the part cannot split
        (`rows` per step after accumulation)."""

    # ------------------------------------------------------------------ the loss

    def loss_fn(self, strategy: Strategy, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        """The loss as the part computes it: `loss` wrapped, replaced, or unchanged."""
        return loss

    def grad_fn(self, strategy: Strategy, policy: Policy, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> GradFn | None:
        """A gradient function of its own (choice), or `None`: the policy's gradient of the loss."""
        return None

    def update(self, strategy: Strategy, update: Update) -> Update:
        """The optimizer update `(grads, opt_state, params, **extra_args) -> (params, opt_state)` as
        the part runs it (`extra_args`: optax extra arguments, e.g. ZeRO's `norm_fn`)."""
        return update


__all__ = ["Part", "KINDS", "LossFn", "GradFn", "Update"]
