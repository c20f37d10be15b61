"""How many layers each pipeline stage runs: equal, given, or balanced by measured FLOPs.

A stage's time per tick is its layers' time plus, on the first virtual stage, the
embedding and, on the last, the final norm, the head and the loss. Every tick waits
for the slowest stage, so an equal split leaves the other stages idle for as long as
the head takes: for GPT-2 small the head (768 x 50304) costs about 5.4 layers.

`balanced_layers` gives the first and last stages fewer layers. Its costs are
*measured*: `measure_costs` lowers the embedding, one layer and the head (each
forward and backward, on one microbatch, from abstract shapes: nothing runs or
compiles) and reads XLA's FLOP count of each, so the split follows the model actually
run (SwiGLU, MoE, a vocabulary of any size), not a formula. `stage_flops` lowers each
whole stage the same way: the figures `docs/parallelism/pipeline.md` tabulates,
equal against balanced.

Counts are per *virtual* stage `g = chunk * p + stage` (the order the activations
travel), and sum to the number of entries of the model's layer stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqgpt.nn.loss import chunked_cross_entropy
from eqgpt.nn.protocol import num_layers


@dataclass(frozen=True)
class StageCosts:
    """FLOPs (forward and backward, one microbatch) of the embedding, one layer and the head (with norm and loss)."""

    embed: float
    layer: float
    head: float

    def stage(self, layers: int, first: bool, last: bool) -> float:
        """The FLOPs of a virtual stage that runs `layers` layers (and the embedding / head if first / last)."""
        return layers * self.layer + first * self.embed + last * self.head


def equal_layers(num_layers: int, num_virtual_stages: int) -> tuple[int, ...]:
    """The default split: the same number of layers on every virtual stage."""
    return (num_layers // num_virtual_stages,) * num_virtual_stages


def check_layers(layers_per_stage: tuple[int, ...], num_layers: int, num_virtual_stages: int) -> None:
    """Raise `ValueError` unless `layers_per_stage` gives each virtual stage >= 0 layers, `num_layers` in all."""
    counts = tuple(layers_per_stage)
    if len(counts) != num_virtual_stages or any(c < 0 for c in counts) or sum(counts) != num_layers:
        raise ValueError(
            f"layers_per_stage={counts} must give each of the {num_virtual_stages} virtual stages (pipeline size "
            f"x chunks) a count >= 0, {num_layers} layers in all; e.g. {equal_layers(num_layers, num_virtual_stages)}"
            " (equal, when it divides) or 'auto' (balanced by measured FLOPs)."
        )


def balanced_layers(costs: StageCosts, num_layers: int, num_virtual_stages: int) -> tuple[int, ...]:
    """The split whose slowest virtual stage is fastest, the embedding and head weighed against layers.

    **Arguments:** the measured `costs`, the number of layers, the number of virtual stages `G`.

    **Returns:** `G` counts summing to `num_layers`. Each layer in turn goes to the
    stage that is cheapest so far (the earliest among equals): with layers of one
    cost this minimises the slowest stage, and every process computes the same split.
    """
    G = num_virtual_stages
    cost = [costs.stage(0, g == 0, g == G - 1) for g in range(G)]
    counts = [0] * G
    for _ in range(num_layers):
        g = min(range(G), key=lambda i: (cost[i], i))
        counts[g] += 1
        cost[g] += costs.layer
    return tuple(counts)


def _is_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _flops(fn, *args) -> float:
    """XLA's FLOP count of `fn(*args)`, forward and backward (with respect to `args[0]` and `args[1]`,
    the parameters and the stage input, as a pipeline's backward computes both). Counted on the
    lowered program, before optimisation: nothing is compiled, and every matmul counts (the compiled
    CPU program's count misses some: a GPT-2 small layer at 1024 tokens is 43.8 GFLOP lowered, 39.0
    compiled, 43.5 by `6 * 12 d^2 * T`)."""
    grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1))
    dynamic = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), eqx.filter(a, _is_array))
               for a in args]
    static = [eqx.filter(a, _is_array, inverse=True) for a in args]
    run = lambda *dyn: grad(*(eqx.combine(d, s) for d, s in zip(dyn, static, strict=True)))  # noqa: E731
    return float(jax.jit(run).lower(*dynamic).cost_analysis().get("flops", 0.0))  # none: an empty stage


def _stage_fn(first: bool, layers: int, last: bool):
    """`(model, tokens or activations, targets) -> loss-like output` of one virtual stage, layers unrolled.

    Layers run one at a time (each a one-layer copy of the stack) so the program holds
    every layer: XLA's cost analysis counts a loop's body once.
    """

    def stage(model, x, tokens, targets):
        positions = jnp.arange(tokens.shape[1])
        h = model.embed(tokens, positions) if first else x
        for i in range(layers):
            one = eqx.tree_at(lambda m: m.blocks, model,
                              jax.tree.map(lambda a, i=i: a[i:i + 1] if _is_array(a) else a, model.blocks))
            h = one.run_blocks(h, positions, None)
        if not last:
            return h
        return chunked_cross_entropy(model.logits, model.norm(h), targets, chunk_size=tokens.shape[1])[0]

    return stage


def stage_flops(model: Any, microbatch: tuple[int, int], layers_per_stage: tuple[int, ...]) -> list[float]:
    """Per virtual stage, the FLOPs of its forward and backward on one microbatch (XLA's count).

    **Arguments:** a model (`eqgpt.nn.LanguageModel`; abstract works, e.g.
    `eqx.filter_eval_shape`), the microbatch shape `(rows, seq)`, the split.
    """
    check_layers(layers_per_stage, num_layers(model), len(layers_per_stage))
    rows, seq = microbatch
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    width = jax.eval_shape(model.embed, tokens, jnp.arange(seq)).shape[-1]
    x = jax.ShapeDtypeStruct((rows, seq, width), jnp.float32)
    G, out, seen = len(layers_per_stage), [], {}
    for g, n in enumerate(layers_per_stage):
        key = (g == 0, n, g == G - 1)
        if key not in seen:
            seen[key] = _flops(_stage_fn(*key), model, x, tokens, tokens)
        out.append(seen[key])
    return out


def measure_costs(model: Any, microbatch: tuple[int, int]) -> StageCosts:
    """The FLOPs (XLA's count) of the embedding, one layer and the head on one microbatch `(rows, seq)`."""
    rows, seq = microbatch
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    width = jax.eval_shape(model.embed, tokens, jnp.arange(seq)).shape[-1]
    x = jax.ShapeDtypeStruct((rows, seq, width), jnp.float32)
    embed = _flops(_stage_fn(True, 0, False), model, x, tokens, tokens)
    layer = _flops(_stage_fn(False, 1, False), model, x, tokens, tokens)
    head = _flops(_stage_fn(False, 0, True), model, x, tokens, tokens)
    return StageCosts(embed=embed, layer=layer, head=head)


def balance_table(model: Any, microbatch: tuple[int, int], num_virtual_stages: int) -> str:
    """A text table: per virtual stage, the layers and measured GFLOPs of the equal and the balanced split.

    The last column is the slowest stage's share of the equal split's slowest: each
    tick waits for the slowest stage, so with the bubble unchanged it is the step's
    compute time relative to the equal split.
    """
    L, G = num_layers(model), num_virtual_stages
    splits = [("auto", balanced_layers(measure_costs(model, microbatch), L, G))]
    if L % G == 0:
        splits.insert(0, ("equal", equal_layers(L, G)))
    header = f"{'split':<7}{'row':<8}" + "".join(f"{'stage ' + str(g):>9}" for g in range(G)) + f"{'slowest':>9}"
    rows, first_max = [header], None
    for name, split in splits:
        gflops = [f / 1e9 for f in stage_flops(model, microbatch, split)]
        first_max = first_max or max(gflops)
        rows.append(f"{name:<7}{'layers':<8}" + "".join(f"{n:>9d}" for n in split))
        rows.append(f"{'':<7}{'GFLOP':<8}" + "".join(f"{f:>9.1f}" for f in gflops)
                    + f"{max(gflops) / first_max:>9.2f}")
    return "\n".join(rows)


__all__ = ["StageCosts", "balance_table", "equal_layers", "check_layers", "balanced_layers", "measure_costs",
           "stage_flops"]
