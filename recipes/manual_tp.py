"""Manual (shard_map) Megatron tensor parallelism, with data and sequence parallelism.

    .venv/bin/python recipes/manual_tp.py                      # data=2 x tensor=4
    .venv/bin/python recipes/manual_tp.py --sp                 # ... with sequence parallelism
    .venv/bin/python recipes/manual_tp.py --mesh tensor=4 --preset llama-nano

Every collective of the step is written in `eqgpt.parallel` (tensor.py,
sequence.py, data.py): Megatron's f/g around attention and the MLP, a
vocabulary-parallel embedding and cross-entropy, and an explicit fp32 gradient
all-reduce over `data`. A plain optax loop trains a few AdamW steps on 8
simulated CPU devices, checks the first loss against one device, and prints the
compiled step's collective table.
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import optax
import tyro
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqgpt
from _parallel_demo import text_batches  # also sets up 8 simulated CPU devices
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.parallel.data import manual_grad_fn, manual_specs
from eqgpt.parallel.shard_map import place
from eqgpt.profile import collective_table


@dataclass
class Args:
    """Train with the manual path and print what it communicates."""

    mesh: str = "data=2,tensor=4"
    """Mesh: axes data and tensor (e.g. 'tensor=8', 'data=2,tensor=4')."""
    sp: bool = False
    """Megatron sequence parallelism on the tensor axis."""
    preset: str = "nano"
    """Model preset (nano: 4 heads, so tensor <= 4; llama-nano: GQA with 2 kv heads)."""
    steps: int = 5
    batch: int = 8
    seq: int = 64


def main(args: Args) -> list[float]:
    config = eqgpt.preset(args.preset, seq_len=max(args.seq, 64))
    mesh = par.make_mesh(args.mesh)
    model = nn.GPT(config, key=jax.random.key(0))
    grad_fn = manual_grad_fn(model, mesh, sequence_parallel=args.sp)  # ValueError here if sizes do not split
    optimizer = optax.adamw(3e-3)

    @eqx.filter_jit
    def step(model, opt_state, tokens):
        (loss, _), grads = grad_fn(model, tokens)  # tokens: [batch, seq + 1]
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    data = text_batches(args.steps, args.batch, args.seq)
    single = float(nn.lm_loss(model, data[0][:, :-1], data[0][:, 1:])[0])

    placed = place(model, mesh, manual_specs(model, mesh))
    q = placed.blocks.attn.q_proj.weight
    print(f"mesh {args.mesh}{' + sp' if args.sp else ''} | q_proj.weight {q.shape} as {q.sharding.spec}, "
          f"{q.addressable_shards[0].data.shape} per device")
    rows = NamedSharding(mesh, P("data" if mesh.shape["data"] > 1 else None, None))
    batches = [jax.device_put(b, rows) for b in data]
    opt_state = optimizer.init(eqx.filter(placed, eqx.is_array))
    compiled = step.lower(placed, opt_state, batches[0]).compile()
    losses = []
    for i, tokens in enumerate(batches):
        placed, opt_state, loss = compiled(placed, opt_state, tokens)
        losses.append(float(loss))
        print(f"step {i}: loss {losses[-1]:.4f}")
    print(f"first loss on one device: {single:.4f} (manual: {losses[0]:.4f})")
    print(collective_table(compiled, mesh=mesh, title=f"manual {args.mesh}{' + sp' if args.sp else ''}"))
    return losses


if __name__ == "__main__":
    main(tyro.cli(Args))
