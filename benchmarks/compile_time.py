"""Compile time of a training step at 4 versus 32 layers.

Layers are scanned, so the compiled program holds one layer body whatever the
depth, and the ratio should stay near 1 (an unrolled stack grows ~8x).
Run: `python benchmarks/compile_time.py`.
"""

import time

import equinox as eqx
import jax
import numpy as np
import optax

import eqgpt
from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.train import TrainState, make_train_step


def compile_seconds(num_layers: int) -> float:
    """Seconds to lower and compile the library's training step (`make_train_step`)."""
    cfg = eqgpt.preset("nano").replace(num_layers=num_layers)
    model = nn.GPT(cfg, key=jax.random.key(0))
    opt = optax.adamw(1e-3)
    state = TrainState(model, opt.init(eqx.filter(model, eqx.is_array)), rng=jax.random.key(1))
    batch = Batch.from_windows(np.zeros((8, cfg.seq_len + 1), np.int32))
    step = make_train_step(opt)
    start = time.perf_counter()
    step.lower(state, batch).compile()
    return time.perf_counter() - start


def main():
    compile_seconds(2)  # warm up tracing caches
    shallow, deep = compile_seconds(4), compile_seconds(32)
    print(f"{'layers':>8} {'compile s':>10}")
    print(f"{4:>8} {shallow:>10.2f}")
    print(f"{32:>8} {deep:>10.2f}")
    print(f"ratio 32/4 layers: {deep / shallow:.2f} (scan keeps it near 1; unrolled would be ~8)")


if __name__ == "__main__":
    main()
