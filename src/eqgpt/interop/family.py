"""One Hugging Face model family as one object: `Family` (its config mapping, tensor map and
name prefixes) and `TensorMap` (one eqgpt array against one Hugging Face tensor).

The families eqgpt knows are registered in `eqgpt.interop.families`; adding one means
writing one `Family` there (see `docs/interop.md`, "Adding a family").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from eqgpt.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one eqgpt array relates to one Hugging Face tensor.

    **Fields:** `eqgpt` (dotted path in the `GPT`, e.g. `blocks.attn.q_proj.weight`),
    `hf` (the tensor name, `{i}` standing for the layer), `layered` (one HF tensor per
    layer, stacked on eqgpt's leading `layers` axis), `part` (`(start, stop)` along the
    HF tensor's last axis: the slice of a fused tensor), `transpose` (HF stores the
    transpose: `nn.Linear`'s `[out, in]`), `experts` (one HF tensor per expert too,
    `{j}` in the name, stacked on eqgpt's `experts` axis after the layers), `vocab_axis`
    (eqgpt's axis of the vocabulary, after the stacked ones: `padded_vocab_size` long in
    eqgpt, `vocab_size` in the file; the padding rows load as zeros and are not exported).
    """

    eqgpt: str
    hf: str
    layered: bool = False
    part: tuple[int, int] | None = None
    transpose: bool = False
    experts: bool = False
    vocab_axis: int | None = None

    @property
    def stacked(self) -> int:
        """Leading eqgpt axes that index HF tensors (layers, experts) rather than their elements."""
        return int(self.layered) + int(self.experts)

    def names(self, c: GPTConfig) -> list[tuple[tuple[int, ...], str]]:
        """`(index on the stacked axes, HF name)` of every HF tensor this array spans."""
        layers = range(c.num_layers) if self.layered else [None]
        experts = range(c.moe.num_experts) if self.experts else [None]
        return [(tuple(k for k in (i, j) if k is not None), self.hf.format(i=i, j=j)) for i in layers for j in experts]


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything eqgpt knows about one Hugging Face model family.

    **Fields:** `name` (the `family=` value and `export --format` choice, e.g. `"llama"`),
    `title` (in messages, `"Llama"`), `model_type` (`config.json`'s), `layout` (`GPTConfig ->
    [TensorMap]`: every array's HF name), `shape` (the `GPTConfig` fields the layout fixes,
    e.g. `norm="rmsnorm"`), `limits` (`GPTConfig -> [problem]`: what else the layout cannot
    hold), `to_hf` (`(GPTConfig, eos_id) -> config.json dict`), `from_hf` (`(config.json dict,
    where) -> GPTConfig`, raising `ValueError` for options eqgpt cannot run), `prefixes`
    (name prefixes a file may put before every tensor's name, tried in order; the first is
    written), `unprefixed` (names written without the prefix), `ignored` (name endings of
    tensors a file may hold that are not parameters).
    """

    name: str
    title: str
    model_type: str
    layout: Callable[[GPTConfig], list[TensorMap]]
    shape: Mapping[str, Any]
    limits: Callable[[GPTConfig], list[str]]
    to_hf: Callable[[GPTConfig, int | None], dict]
    from_hf: Callable[[Mapping, str], GPTConfig]
    prefixes: tuple[str, ...] = ("",)
    unprefixed: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    def fits(self, c: GPTConfig) -> list[str]:
        """What about `c` this family's layout cannot hold (empty: it fits)."""
        bad = [f"{k}={getattr(c, k)!r} (it has {v!r})" for k, v in self.shape.items() if getattr(c, k) != v]
        return bad + self.limits(c)

    def prefix(self, names: set[str], c: GPTConfig) -> str:
        """The prefix a file's tensor `names` carry: the first of `prefixes` its first tensor has."""
        first = self.layout(c)[0].hf
        return next((p for p in self.prefixes if p + first in names), self.prefixes[-1])

    def file_name(self, prefix: str, hf_name: str) -> str:
        """The name `hf_name` has in a file whose tensors carry `prefix` (`unprefixed` names carry none)."""
        return hf_name if hf_name.startswith(self.unprefixed) else prefix + hf_name

    def export_name(self, hf_name: str) -> str:
        """The name `hf_name` is written under."""
        return self.file_name(self.prefixes[0], hf_name)


def require(hf: Mapping, key: str, where: str) -> Any:
    """`hf[key]`, or a `ValueError` saying the config `where` is incomplete."""
    if hf.get(key) is None:
        raise ValueError(f"{where} has no {key!r}; it is not a complete Hugging Face config.")
    return hf[key]
