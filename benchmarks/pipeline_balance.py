"""Per-stage FLOPs of a pipeline, equal against balanced layers (`layers_per_stage="auto"`).

Lowers every virtual stage of the model (its layers, and the embedding or the head
on the first or last) forward and backward on one microbatch, and prints XLA's
FLOP count of each (`eqgpt.parallel.pipeline.balance_table`). No device runs
anything; the model is abstract. Run:
`python benchmarks/pipeline_balance.py --preset gpt2-small --stages 4`.
"""

import argparse

import equinox as eqx
import jax

from eqgpt import nn
from eqgpt.config import preset
from eqgpt.parallel.pipeline import balance_table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="virtual stages (pipeline x chunks)")
    parser.add_argument("--rows", type=int, default=1, help="rows per microbatch")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    seq = args.seq or config.seq_len
    model = eqx.filter_eval_shape(lambda k: nn.GPT(config, key=k), jax.random.key(0))
    for g in args.stages:
        print(f"{args.preset}: {config.num_layers} layers on {g} virtual stages, microbatch {args.rows} x {seq}, "
              "GFLOP forward + backward per stage")
        print(balance_table(model, (args.rows, seq), g))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
