"""Manual Megatron sequence parallelism (SP): the residual stream split on `seq`.

Plain tensor parallelism leaves the residual stream, the norms and the residual
adds *replicated* on every device of the `tensor` axis, and joins the regions with
two operators per sub-layer: `f` (identity forward, all-reduce backward) before
the column-parallel input and `g` (all-reduce forward, identity backward) after the
row-parallel output. SP (Korthikanti et al., 2022) splits those replicated parts
along the sequence instead, and trades each all-reduce for its two halves:

```text
            TP                                    TP + SP
  x [b, T, D] (replicated)              x [b, T/n, D] (sequence shard)
  norm(x)         (repeated n times)    norm(x)           (1/n of the work)
  f: identity | all-reduce (bwd)        all-gather on seq | reduce-scatter (bwd)
  column-parallel ... row-parallel      column-parallel ... row-parallel
  g: all-reduce | identity (bwd)        reduce-scatter on seq | all-gather (bwd)
```

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes on
the wire are the same, `2 (n-1)/n * |[b, T, D]|` per sub-layer and direction,
while the activations of norms and residuals shrink `n` times.

Weights kept whole on every device (norm scales, biases of row-parallel outputs,
position embeddings) now see different tokens on each device, so their gradients
are partial and are summed over `tensor`; `eqgpt.parallel.manual.manual_grad_fn`
does that sum explicitly, as Megatron does for its norm weights under SP.

The operators here act on the `seq` dimension (1 by default) of `[batch, seq, ...]`
arrays; `eqgpt.parallel.tensor` uses them in place of `f` and `g` (this module
imports nothing of it: no cycle).
"""

from __future__ import annotations

from jaxtyping import Array, Shaped

from eqgpt.parallel.collectives import AxisName, all_gather, reduce_scatter


def gather_sequence(
    x: Shaped[Array, "batch seq_shard *rest"], axis: AxisName
) -> Shaped[Array, "batch seq *rest"]:
    """All-gather the sequence shards: `[b, T/n, ...]` -> `[b, T, ...]` (varying over `axis`).

    **Bytes per device:** `(n-1)/n * |[b, T, ...]|`. **Gradient:** reduce-scatter on `seq`.
    """
    return all_gather(x, axis, dim=1)


def scatter_sequence(x: Shaped[Array, "..."], axis: AxisName, *, dim: int = 1) -> Shaped[Array, "..."]:
    """Sum partial results over `axis` and keep this device's sequence shard: `[b, T, ...]` -> `[b, T/n, ...]`.

    `dim` is the sequence dimension (1 for `[batch, seq, ...]`).

    **Bytes per device:** `(n-1)/n * |[b, T, ...]|`. **Gradient:** all-gather on `seq`.
    """
    return reduce_scatter(x, axis, dim=dim)


def check_sequence_length(seq_len: int, size: int) -> None:
    """Raise `ValueError` unless the sequence splits evenly over `size` devices."""
    if seq_len % size:
        raise ValueError(
            f"sequence parallelism splits the sequence over {size} devices, but the batch has "
            f"{seq_len} positions; use a sequence length divisible by {size}."
        )
