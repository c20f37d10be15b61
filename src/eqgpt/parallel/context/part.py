"""Context parallelism as a `Strategy` part: `Context`.

The rules split activations' sequence over `context` (`context_rules`), the
attention modules get a `ContextKernel` (`use_context_attention`; the parameter
tree does not change) and the loss is the sequence-sharded one (`context_loss_fn`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import jax
from jaxtyping import Array, PyTree

from eqgpt.nn.attention import Attention
from eqgpt.parallel.context.kernel import DEFAULT_BLOCK, IMPLS, Impl
from eqgpt.parallel.context.layout import check_layout, layout_batch
from eqgpt.parallel.context.loss import context_loss_fn, context_rules
from eqgpt.parallel.context.model import strip_context_attention, use_context_attention
from eqgpt.parallel.context.ulysses import kv_replication
from eqgpt.parallel.part import LossFn, Part
from eqgpt.parallel.rules import Rules

if TYPE_CHECKING:
    from eqgpt.parallel.strategy import Strategy

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class Context(Part):
    """The sequence split over the mesh's `context` axis: `Context("ring")`.

    **Fields:** `impl` ("ring", "allgather" or "ulysses"), `ordering` of the sequence
    over the devices ("zigzag" balances causal work for ring and all-gather;
    "contiguous"; Ulysses needs neither), `block` (tile size of the blockwise kernel
    on each device, ring and all-gather; smaller when a device holds fewer tokens),
    `axis` (the mesh axis the sequence is split over).
    """

    impl: Impl = "ring"
    ("Split the sequence over the mesh's 'context' axis (zigzag order) with ring, all-gather or Ulysses (all-to-all; "
     "heads divisible by context) attention.")
    ordering: Literal["zigzag", "contiguous"] = "zigzag"
    """Order of the sequence over the context devices (zigzag balances causal work)."""
    block: int = DEFAULT_BLOCK
    """Tile size of the blockwise kernel on each device (ring and all-gather)."""
    axis: str = "context"
    """The mesh axis the sequence is split over."""

    name = "context"
    order = 20
    hints = {"context": "add --context ring"}
    on_manual_path = False
    switch = "impl"

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"unknown context attention {self.impl!r}; choose one of {IMPLS}.")
        if self.ordering not in ("zigzag", "contiguous"):
            raise ValueError(f"unknown context ordering {self.ordering!r}; choose 'zigzag' or 'contiguous'.")
        if self.block < 1:
            raise ValueError(f"block must be >= 1, got {self.block}.")

    @property
    def sequence_axis(self) -> str:
        return self.axis

    def rules(self, strategy: Strategy, rules: Rules) -> Rules:
        return rules if self.axis in rules.axes("seq", "activations") else context_rules(rules, axis=self.axis)

    def prepare(self, strategy: Strategy, model: PyTree) -> PyTree:
        return use_context_attention(model, strategy.mesh, self,
                                     batch_axes=strategy.rules.axes("batch", "activations"))

    @classmethod
    def unprepare(cls, model: PyTree) -> PyTree:
        return strip_context_attention(model)

    def split_sequence_in_stages(self, mesh: Any, model: PyTree,
                                 fields: dict[str, Array]) -> tuple[PyTree, dict[str, Array], Array]:
        fields = layout_batch(fields, mesh.shape[self.axis], self.ordering)
        positions = fields.pop("positions")
        return use_context_attention(model, mesh, self._in_stage()), fields, positions  # the same arrays

    def _in_stage(self) -> "Context":
        """What a pipeline stage runs: all-gather for ring (its permutes cannot run inside a stage's
        branch; see eqgpt.parallel.pipeline.executor); all-gather and Ulysses as they are (their
        groups are one stage's context peers)."""
        if self.impl in ("allgather", "ulysses"):
            return self
        if self.impl not in _LOGGED:
            _LOGGED.add(self.impl)
            _log.warning("pipeline x context: attention inside a stage runs as all-gather, not %s (a ring's "
                         "permutes cannot run inside the stage's branch; see eqgpt.parallel.pipeline.executor).",
                         self.impl)
        return dataclasses.replace(self, impl="allgather")

    def check(self, strategy: Strategy, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        if strategy.mesh.shape.get(self.axis, 1) < 2:
            mesh = ",".join(f"{a}={n}" for a, n in strategy.mesh.shape.items() if n > 1)
            raise ValueError(f"--context {self.impl} splits the sequence over the mesh's '{self.axis}' axis, and "
                             f"--mesh {mesh} has none: add {self.axis}=N to --mesh (e.g. {self.axis}=2,data=4), "
                             "or drop --context.")
        check_layout(seq_len, strategy.mesh.shape[self.axis], self.ordering)
        if self.impl == "ulysses":
            is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
            for attn in filter(is_attention, jax.tree.leaves(model_like, is_leaf=is_attention)):
                kv_replication(attn.num_heads, attn.num_kv_heads, strategy.mesh.shape[self.axis])

    def loss_fn(self, strategy: Strategy, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        return context_loss_fn(strategy.mesh, ordering=self.ordering, axis=self.axis, chunk_size=chunk_size,
                               z_loss=z_loss)

    def describe(self, strategy: Strategy) -> str:
        return f"context {self.impl}"


__all__ = ["Context"]
