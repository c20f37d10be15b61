"""Manual (shard_map) Megatron tensor parallelism, with data and sequence parallelism.

    .venv/bin/python recipes/manual_tp.py                      # data=2 x tensor=4
    .venv/bin/python recipes/manual_tp.py --sp                 # ... with sequence parallelism
    .venv/bin/python recipes/manual_tp.py --mesh tensor=4 --preset llama-nano

Every collective of the step is written in `eqgpt.parallel` (tensor.py,
sequence.py, manual.py): Megatron's f/g around attention and the MLP, a
vocabulary-parallel embedding and cross-entropy, and an explicit fp32 gradient
all-reduce over `data`. The model is the plain `GPT`: leaf layers are swapped
for their parallel forms inside the step only. Trains a few AdamW steps on 8
simulated CPU devices and prints the compiled step's collectives. The same runs
from the main recipe: `train_gpt.py --mesh data=2,tensor=4 --strategy dp+sp --manual`.
"""

from __future__ import annotations

from dataclasses import dataclass

import tyro

import eqgpt
from _parallel_demo import train  # first: 8 simulated CPU devices
from eqgpt.parallel import Manual, Strategy, make_mesh


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


def main(args: Args) -> list[float]:
    mesh = make_mesh(args.mesh)
    rules = ("dp+" if mesh.shape["data"] > 1 else "") + ("sp" if args.sp else "tp")
    return train(Strategy(mesh, rules, parts=(Manual(),)), config=eqgpt.preset(args.preset, seq_len=64),
                 steps=args.steps)


if __name__ == "__main__":
    main(tyro.cli(Args))
