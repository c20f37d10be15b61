"""How much attention work each device of the context axis does: blocks computed.

Ring and all-gather attention skip work from positions alone, at two levels,
with the same predicate `Mask.block_may_attend` the kernels use:

- a *ring step* (the local queries against one visiting key/value shard) is
  skipped when no query of the shard may attend any key of the other
  (`shard_may_attend`, which looks at the two halves of each shard);
- inside a step, a *tile* (`block_q` query rows by `block_k` keys, as the
  blockwise kernel cuts the local shards) is skipped likewise.

`block_counts` counts the tiles each device computes, summed over all key
shards; `step_counts` counts ring steps. Under a causal mask and `contiguous`
order device `i` computes `i + 1` of the `n` steps (max/min = `n`); under
`zigzag` every device computes the same number of tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eqgpt.nn.mask import Mask
from eqgpt.parallel.context.layout import Ordering, device_positions
from eqgpt.parallel.context.ring import shard_may_attend


def _pairwise(predicate, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`predicate(a[i], b[j])` for every block `i` of `a` and `j` of `b`."""
    f = jax.vmap(jax.vmap(predicate, (None, 0)), (0, None))
    return np.asarray(jax.jit(f)(jnp.asarray(a), jnp.asarray(b)))


def _steps(mask: Mask, pos: np.ndarray) -> np.ndarray:
    return _pairwise(lambda q, k: shard_may_attend(mask, q, k), pos, pos)


def step_counts(seq_len: int, size: int, ordering: Ordering, mask: Mask) -> np.ndarray:
    """Ring steps (key/value shards) each device computes: int `[size]`."""
    pos = device_positions(seq_len, size, ordering)
    return _steps(mask, pos).sum(axis=1)


def block_counts(
    seq_len: int, size: int, ordering: Ordering, mask: Mask, *, block_q: int = 128, block_k: int = 128
) -> np.ndarray:
    """(query tile, key tile) pairs each device computes over all key shards: int `[size]`.

    **Arguments:** the sequence length, the context axis size, the ordering, the mask,
    and the kernel's tile sizes (which must divide the local shard length
    `seq_len / size`; under zigzag also the chunk length `seq_len / (2 size)`
    for tiles not to straddle the device's two chunks).

    **Returns:** the number of tiles computed by each device.
    """
    pos = device_positions(seq_len, size, ordering)
    shard = pos.shape[1]
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if shard % block:
            raise ValueError(
                f"{name}={block} does not divide the local shard of {shard} tokens; "
                "choose a tile size that divides seq_len / context."
            )
    steps = _steps(mask, pos)  # [i, j]: device i computes the shard of device j
    q_tiles = pos.reshape(-1, block_q)  # [size * tq, block_q]
    k_tiles = pos.reshape(-1, block_k)
    tiles = _pairwise(mask.block_may_attend, q_tiles, k_tiles).reshape(size, shard // block_q, size, shard // block_k)
    return (tiles & steps[:, None, :, None]).sum(axis=(1, 2, 3))


def balance_table(
    seq_len: int, size: int, mask: Mask, *, block_q: int = 128, block_k: int = 128
) -> str:
    """A text table of `step_counts` and `block_counts` per device, both orderings, with max/min."""
    rows = []
    header = f"{'ordering':<11}{'count':<7}" + "".join(f"{'dev ' + str(i):>8}" for i in range(size)) + f"{'max/min':>9}"
    for ordering in ("contiguous", "zigzag"):
        for label, counts in (
            ("steps", step_counts(seq_len, size, ordering, mask)),
            ("tiles", block_counts(seq_len, size, ordering, mask, block_q=block_q, block_k=block_k)),
        ):
            ratio = counts.max() / max(counts.min(), 1)
            rows.append(f"{ordering:<11}{label:<7}" + "".join(f"{c:>8d}" for c in counts) + f"{ratio:>9.2f}")
    return "\n".join([header, *rows])


__all__ = ["step_counts", "block_counts", "balance_table"]
