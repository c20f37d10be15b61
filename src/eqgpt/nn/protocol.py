"""`LanguageModel`: what the pipeline (and other layer-wise strategies) read of a model.

A model distributes as a pipeline without the executor knowing its class when it
has these five members and keeps its layers stacked on a leading axis:

- `embed(tokens, positions) -> x`: token ids `[batch, seq]` and the global
  positions `[seq]` of those tokens to activations `[batch, seq, embed]`.
- `blocks`: a pytree (usually one `eqx.Module` built with `eqx.filter_vmap`)
  whose arrays all carry a leading `layers` axis of the same length.
- `run_blocks(x, positions, segment_ids) -> x`: apply every layer of `blocks`
  in turn (a `jax.lax.scan`). A pipeline stage calls it on a copy of the model
  whose `blocks` hold only that stage's layers, so it must take the layer count
  from the arrays, never from a config.
- `norm(h) -> h`: the final normalisation.
- `logits(h) -> [batch, seq, vocab]`: the output head.

Optional members, read where present (`OPTIONAL`): `seq_len` (the longest
sequence), `logical_sizes()` (each logical axis's size and `seq_len`: what a mesh
must divide), `moe` (the MoE layers' `MoEConfig`, for their router losses, or
`None`) and `num_moe_layers`.

Nothing else is read: no config, no names of embedding or head modules. The
width comes from `jax.eval_shape` of `embed`, the layer count from the arrays of
`blocks` (`num_layers`). `eqgpt.nn.GPT` satisfies it; see
`docs/parallelism/pipeline.md` and `docs/extending.md` for a model of your own.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jaxtyping import Array, Float, Int


@runtime_checkable
class LanguageModel(Protocol):
    """The model protocol.

    - `blocks`: the layers, one module whose arrays are stacked on a leading `layers` axis.
    - `embed(tokens, positions)`: `[batch, seq]` ids -> `[batch, seq, embed]` activations.
    - `run_blocks(x, positions, segment_ids)`: apply every layer in turn (`jax.lax.scan`
      over `blocks`).
    - `norm(h)`: the final norm; `logits(h)`: the output head.
    """

    blocks: Any

    def embed(self, tokens: Int[Array, "batch seq"], positions: Int[Array, " seq"]) -> Float[Array, "batch seq embed"]:
        ...

    def run_blocks(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        ...

    def norm(self, h: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        ...

    def logits(self, h: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        ...


MEMBERS = ("embed", "blocks", "run_blocks", "norm", "logits")
OPTIONAL = ("seq_len", "logical_sizes", "moe", "num_moe_layers")


def check_language_model(model: Any) -> None:
    """Raise `ValueError` naming what is missing if `model` does not satisfy `LanguageModel`."""
    missing = [name for name in MEMBERS if not hasattr(model, name)]
    if missing:
        raise ValueError(
            f"{type(model).__name__} does not satisfy eqgpt.nn.LanguageModel: it lacks {missing}. A pipeline "
            "reads a model through embed(tokens, positions), blocks (layers stacked on a leading axis), "
            "run_blocks(x, positions, segment_ids), norm(h) and logits(h); see docs/parallelism/pipeline.md."
        )


def num_layers(model: Any) -> int:
    """Layers of `model`: the common leading axis of the arrays in `model.blocks`.

    Works on abstract models (`eqx.filter_eval_shape`) too. Raises `ValueError` if
    `blocks` holds no arrays or their leading axes differ.
    """
    leads = {int(np.shape(x)[0]) for x in jax.tree.leaves(model.blocks)
             if hasattr(x, "shape") and len(np.shape(x)) > 0}
    if len(leads) != 1:
        raise ValueError(
            "a LanguageModel's `blocks` must hold its layers stacked on one leading axis (build them with "
            f"eqx.filter_vmap, as eqgpt.nn.GPT does); found leading sizes {sorted(leads)}."
        )
    return leads.pop()


__all__ = ["LanguageModel", "check_language_model", "num_layers", "MEMBERS"]
