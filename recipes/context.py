"""Long sequences: context parallelism with ring or all-gather attention, on 8 CPU devices.

    .venv/bin/python recipes/context.py                                # context=4,data=2, 1024 tokens, ring
    .venv/bin/python recipes/context.py --context allgather
    .venv/bin/python recipes/context.py --mesh context=2,tensor=2,fsdp=2 --strategy fsdp+tp
    .venv/bin/python recipes/context.py --seq-len 8192 --steps 3       # a long sequence (minutes on CPU)

The sequence is split over `context`: each device embeds, projects and runs the
MLP on `seq_len / context` tokens, and attention is exact over the whole sequence
(`--context ring`: key/value shards travel around the devices; `allgather`: they
are gathered once). Batches are put into zigzag order once per step, so causal
work is the same on every device. The model's parameters are the plain `GPT`'s:
only the attention kernel is swapped. See docs/parallelism/context.md. The same
runs from the main recipe: `train_gpt.py --mesh context=4,data=2 --context ring`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import tyro

import eqgpt
from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt.parallel import Context, Strategy, make_mesh


@dataclass
class Args:
    """Train a small Llama-style model on long byte sequences with context parallelism."""

    mesh: str = "context=4,data=2"
    """Mesh sizes, e.g. context=4,data=2 or context=2,tensor=2,fsdp=2."""
    seq_len: int = 1024
    """Tokens per sequence; zigzag needs a multiple of 2 * context."""
    context: Literal["ring", "allgather", "ulysses"] = "ring"
    ("ring: k/v shards rotate (memory 1/n); allgather: k/v gathered once (fewer, larger messages); ulysses: "
     "all-to-all to head-sharded (heads divisible by context).")
    ordering: Literal["zigzag", "contiguous"] = "zigzag"
    """Sequence layout over the context axis (zigzag balances causal work)."""
    strategy: str = "dp"
    """The rest of the mesh: dp, fsdp, tp or a + of them (context rules are added)."""
    batch_size: int = 4
    """Sequences per step (global)."""
    steps: int = 5
    """AdamW steps."""


def main(args: Args) -> list[float]:
    config = eqgpt.preset("llama-nano").replace(
        seq_len=args.seq_len, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, mlp_dim=172
    )
    strategy = Strategy(make_mesh(args.mesh), args.strategy,
                        parts=(Context(args.context, ordering=args.ordering),))
    return train(strategy, config=config, steps=args.steps, batch=args.batch_size)


if __name__ == "__main__":
    main(tyro.cli(Args))
