"""Long sequences: context parallelism with ring or all-gather attention, on 8 CPU devices.

    .venv/bin/python recipes/context.py                                # context=4,data=2, 1024 tokens, ring
    .venv/bin/python recipes/context.py --context-attention allgather
    .venv/bin/python recipes/context.py --mesh context=2,tensor=2,fsdp=2 --strategy fsdp+tp
    .venv/bin/python recipes/context.py --seq-len 8192 --steps 3       # a long sequence (minutes on CPU)

The sequence is split over `context`: each device embeds, projects and runs the
MLP on `seq_len / context` tokens, and attention is exact over the whole sequence
(`--context-attention ring`: key/value shards travel around the devices;
`allgather`: they are gathered once). Batches are put into zigzag order once per
step, so causal work is the same on every device. See docs/parallelism/context.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import equinox as eqx
import jax
import optax
import tyro

import eqgpt
from _parallel_demo import text_batches  # also sets up 8 simulated CPU devices
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.parallel import context as cp
from eqgpt.profile import report


@dataclass
class Args:
    """Train a small Llama-style model on long byte sequences with context parallelism."""

    mesh: str = "context=4,data=2"
    """Mesh sizes, e.g. context=4,data=2 or context=2,tensor=2,fsdp=2."""
    seq_len: int = 1024
    """Tokens per sequence; zigzag needs a multiple of 2 * context."""
    context_attention: Literal["ring", "allgather"] = "ring"
    """ring: k/v shards rotate (memory 1/n); allgather: k/v gathered once (fewer, larger messages)."""
    ordering: Literal["zigzag", "contiguous"] = "zigzag"
    """Sequence layout over the context axis (zigzag balances causal work)."""
    strategy: str = "dp"
    """The rest of the mesh: dp, fsdp, tp or a + of them (context rules are added)."""
    batch_size: int = 4
    """Sequences per step (global)."""
    steps: int = 5
    """AdamW steps."""
    block: int = 128
    """Tile size of the blockwise kernel on each device."""
    report: bool = False
    """Print the compiled step's collectives and memory."""


def main(args: Args) -> list[float]:
    mesh = par.make_mesh(args.mesh)
    n = mesh.shape["context"]
    cp.check_layout(args.seq_len, n, args.ordering)  # ValueError before anything compiles
    config = eqgpt.preset("llama-nano").replace(
        seq_len=args.seq_len, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, mlp_dim=172
    )
    rules = cp.context_rules(args.strategy)
    par.check_divisibility(config, mesh, rules, args.batch_size, args.seq_len)
    placement = par.ShardedPlacement(mesh, rules)
    block = min(args.block, args.seq_len // (2 * n))
    model = placement.init_model(
        lambda k: cp.use_context_attention(nn.GPT(config, key=k), mesh, args.context_attention,
                                           block_q=block, block_k=block),
        jax.random.key(0),
    )
    optimizer = optax.adamw(3e-3)
    opt_state = placement.init_opt_state(optimizer, model)
    grad_fn = cp.context_grad_fn(mesh, ordering=args.ordering)

    @eqx.filter_jit
    def step(model, opt_state, batch):
        (loss, _), grads = grad_fn(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    print(f"mesh {args.mesh} | {args.context_attention} attention, {args.ordering} order | "
          f"{args.seq_len} tokens per sequence, {args.seq_len // n} per device")
    batches = [placement.batch(b) for b in text_batches(args.steps, args.batch_size, args.seq_len)]
    compiled = step.lower(model, opt_state, batches[0]).compile()
    losses = []
    for i, batch in enumerate(batches):
        model, opt_state, loss = compiled(model, opt_state, batch)
        losses.append(float(loss))
        print(f"step {i}: loss {losses[-1]:.4f}")
    if args.report:
        print(report(compiled, mesh=mesh, title=f"cp {args.context_attention}"))
    return losses


if __name__ == "__main__":
    main(tyro.cli(Args))
