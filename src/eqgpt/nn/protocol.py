"""`LanguageModel`: the contract between a model and every strategy, as an abstract `eqx.Module`.

A model trains under every strategy (one device, the automatic and manual paths,
the pipeline, context parallelism) when it subclasses `LanguageModel` and keeps its
layers stacked on a leading axis. Six members are abstract; a subclass lacking one
cannot be instantiated (`TypeError` naming it), and `Strategy.check` refuses a model
that is not a `LanguageModel` naming what it lacks:

- `blocks`: a pytree (usually one `eqx.Module` built with `eqx.filter_vmap`)
  whose arrays all carry a leading `layers` axis of the same length.
- `embed(tokens, positions) -> x`: token ids `[batch, seq]` and the global
  positions `[seq]` of those tokens to activations `[batch, seq, embed]`.
- `run_blocks(x, positions, segment_ids) -> x`: apply every layer of `blocks`
  in turn (a `jax.lax.scan`). A pipeline stage calls it on a copy of the model
  whose `blocks` hold only that stage's layers, so it must take the layer count
  from the arrays, never from a config.
- `norm(h) -> h`: the final normalisation (a method, or a field holding a module).
- `logits(h) -> [batch, seq, vocab]`: the output head.
- `logical_sizes()`: each logical axis's size (and `seq_len`): what a mesh must divide.

The rest have defaults a model overrides where it has more to say: `seq_len` (`None`: no
limit), `moe` and `num_moe_layers` (`None`, `0`: dense), `run_blocks_with_stats` (no MoE
statistics), `features_and_stats` and `features` (embed, blocks, norm), `scanned` (the model
itself), `head_logits` (`logits`), and `head_matrix` (`None`: the loss takes the chunked
head through `logits`; a matrix of `vocab_size` real rows is fused with the loss).

Nothing else is read: no config, no names of embedding or head modules. The width
comes from `jax.eval_shape` of `embed`, the layer count from the arrays of `blocks`
(`num_layers`). `eqgpt.nn.GPT` implements it; see `docs/extending.md`.
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


class LanguageModel(eqx.Module):
    """The model contract (see the module docs)."""

    blocks: eqx.AbstractVar[Any]
    norm: eqx.AbstractVar[Callable[[Float[Array, "batch seq embed"]], Float[Array, "batch seq embed"]]]

    @abc.abstractmethod
    def embed(self, tokens: Int[Array, "batch seq"], positions: Int[Array, " seq"]) -> Float[Array, "batch seq embed"]:
        """`[batch, seq]` ids -> `[batch, seq, embed]` activations."""

    @abc.abstractmethod
    def run_blocks(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> Float[Array, "batch seq embed"]:
        """Apply every layer of `blocks` in turn (`jax.lax.scan`)."""

    @abc.abstractmethod
    def logits(self, h: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq vocab"]:
        """The output head."""

    @abc.abstractmethod
    def logical_sizes(self) -> dict[str, int]:
        """The size of each logical axis of the model's arrays, and `seq_len`."""

    @property
    def seq_len(self) -> int | None:
        """The longest sequence the model takes (`None`: no limit)."""
        return None

    @property
    def moe(self) -> Any:
        """The `MoEConfig` of its MoE layers (their router losses), or `None` for a dense model."""
        return None

    @property
    def num_moe_layers(self) -> int:
        """How many of its layers are MoE layers."""
        return 0

    @property
    def vocab_size(self) -> int | None:
        """The real rows of `head_matrix()` (`None`: all of them)."""
        return None

    def run_blocks_with_stats(
        self, x: Float[Array, "batch seq embed"], positions: Int[Array, " seq"],
        segment_ids: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        """`run_blocks`, and its MoE router statistics (`None`: a dense model)."""
        return self.run_blocks(x, positions, segment_ids), None

    def features_and_stats(
        self, tokens: Int[Array, "batch seq"], *, positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, doc_positions: Int[Array, "batch seq"] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], Any]:
        """Final-norm hidden states and the router statistics (`doc_positions`: packed documents'
        per-row positions, which this default does not take)."""
        if doc_positions is not None:
            raise ValueError(f"{type(self).__name__} does not take per-row document positions (packed "
                             "documents); override features_and_stats, or train on windows.")
        positions = jnp.arange(tokens.shape[1]) if positions is None else positions
        x, stats = self.run_blocks_with_stats(self.embed(tokens, positions), positions, segment_ids)
        return self.norm(x), stats

    def features(self, tokens: Int[Array, "batch seq"], **kwargs) -> Float[Array, "batch seq embed"]:
        """Final-norm hidden states: everything but the head."""
        return self.features_and_stats(tokens, **kwargs)[0]

    def scanned(self) -> "LanguageModel":
        """This model with its layers run as one loop, for programs that run rarely (validation,
        sampling), where compile time counts more than step time: the same arrays and function.
        The default returns the model itself."""
        return self

    def head_logits(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """The output head without a layout of its activations (context parallelism's loss
        lays them out itself); `logits` by default."""
        return self.logits(h)

    def head_matrix(self) -> Float[Array, "vocab embed"] | None:
        """The output head as `[vocab, embed]`, for the loss to fuse (`None`: not fused)."""
        return None


ABSTRACT = ("blocks", "embed", "run_blocks", "norm", "logits", "logical_sizes")


def check_language_model(model: Any) -> None:
    """Raise `ValueError` naming what is missing if `model` is not a `LanguageModel`."""
    if isinstance(model, LanguageModel):
        return
    missing = [name for name in ABSTRACT if name not in dir(model)]
    raise ValueError(
        f"{type(model).__name__} is not an eqgpt.nn.LanguageModel"
        + (f": it lacks {missing}" if missing else "")
        + ". Subclass eqgpt.nn.LanguageModel and define blocks (layers stacked on a leading axis), "
        "embed(tokens, positions), run_blocks(x, positions, segment_ids), norm(h), logits(h) and "
        "logical_sizes(); see docs/extending.md."
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


__all__ = ["LanguageModel", "check_language_model", "num_layers", "ABSTRACT"]
