"""Context parallelism as a `Strategy` part: `ContextPart`.

The rules split activations' sequence over `context` (`context_rules`), the
attention modules get a `ContextKernel` (`use_context_attention`; the parameter
tree does not change) and the loss is the sequence-sharded one (`context_loss_fn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jaxtyping import PyTree

from eqgpt.nn.attention import Attention
from eqgpt.parallel.context.kernel import ContextConfig
from eqgpt.parallel.context.layout import check_layout
from eqgpt.parallel.context.loss import context_loss_fn, context_rules
from eqgpt.parallel.context.model import use_context_attention
from eqgpt.parallel.context.ulysses import kv_replication
from eqgpt.parallel.part import LossFn, Part
from eqgpt.parallel.rules import Rules


@dataclass(frozen=True)
class ContextPart(Part):
    """`Strategy(context=ContextConfig(...))`: the sequence split over `context`."""

    config: ContextConfig

    name = "context"
    hints = {"context": "add --context ring"}

    @classmethod
    def of(cls, strategy: Any) -> ContextPart | None:
        return None if strategy.context is None else cls(strategy.context)

    def rules(self, strategy: Any, rules: Rules) -> Rules:
        return rules if "context" in rules.axes("seq", "activations") else context_rules(rules)

    def prepare(self, strategy: Any, model: PyTree) -> PyTree:
        return use_context_attention(model, strategy.mesh, self.config,
                                     batch_axes=strategy.rules.axes("batch", "activations"))

    def check(self, strategy: Any, model_like: PyTree, *, rows: int, seq_len: int) -> None:
        check_layout(seq_len, strategy.mesh.shape["context"], self.config.ordering)
        if self.config.impl == "ulysses":
            is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
            for attn in filter(is_attention, jax.tree.leaves(model_like, is_leaf=is_attention)):
                kv_replication(attn.num_heads, attn.num_kv_heads, strategy.mesh.shape[self.config.axis])

    def loss_fn(self, strategy: Any, loss: LossFn, *, chunk_size: int, z_loss: float,
                model_like: PyTree) -> LossFn:
        return context_loss_fn(strategy.mesh, ordering=self.config.ordering, chunk_size=chunk_size, z_loss=z_loss)

    def describe(self, strategy: Any) -> str:
        return f"context {self.config.impl}"


__all__ = ["ContextPart"]
