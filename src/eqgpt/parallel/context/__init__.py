"""Context parallelism: the sequence split over the `context` mesh axis.

- `layout`: zigzag / contiguous orderings of the sequence, applied once to a batch.
- `ring`, `allgather`, `ulysses`: exact attention inside `shard_map` (k/v rotate, are
  gathered, or all-to-alls make the shards head-sharded for the local kernel).
- `kernel`: `ContextKernel`, either one behind the ordinary kernel signature.
- `part`: `Context`, context parallelism as a `Strategy` part (its settings).
- `model`: `use_context_attention` swaps it in as the attention modules' kernel
  (the parameter tree does not change).
- `loss`: rules and the sequence-sharded loss of a `Batch`.
- `balance`: attention tiles and ring steps computed per device.

See `docs/parallelism/context.md`.
"""

from eqgpt.parallel.context.allgather import allgather_attention
from eqgpt.parallel.context.balance import balance_table, block_counts, step_counts
from eqgpt.parallel.context.kernel import IMPLS, ContextKernel
from eqgpt.parallel.context.layout import (
    ORDERINGS,
    check_layout,
    device_positions,
    from_layout,
    layout_batch,
    layout_positions,
    to_layout,
)
from eqgpt.parallel.context.loss import (
    CP,
    context_loss_fn,
    context_rules,
    sharded_cross_entropy,
)
from eqgpt.parallel.context.model import (
    context_kernels,
    strip_context_attention,
    use_context_attention,
)
from eqgpt.parallel.context.part import Context
from eqgpt.parallel.context.ring import ring_attention, shard_may_attend
from eqgpt.parallel.context.ulysses import (
    kv_replication,
    reads_positions,
    ulysses_attention,
    ulysses_bytes,
)

__all__ = [
    "ContextKernel", "Context", "IMPLS", "use_context_attention", "strip_context_attention",
    "context_kernels", "ring_attention", "shard_may_attend",
    "allgather_attention", "ulysses_attention", "ulysses_bytes", "kv_replication", "reads_positions", "ORDERINGS",
    "check_layout", "layout_positions", "device_positions",
    "to_layout", "from_layout", "layout_batch", "CP", "context_rules",
    "sharded_cross_entropy", "context_loss_fn", "block_counts", "step_counts",
    "balance_table",
]
