"""Compile time of a training step at 4 versus 32 layers.

Layers are scanned, so the compiled program holds one layer body whatever the
depth, and the ratio should stay near 1 (an unrolled stack grows ~8x).
Run: `python benchmarks/compile_time.py`.
"""

import time

import equinox as eqx
import jax
import optax

import eqgpt
from eqgpt import nn


def compile_seconds(num_layers: int) -> float:
    cfg = eqgpt.preset("nano").replace(num_layers=num_layers)
    model = nn.GPT(cfg, key=jax.random.key(0))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    toks = jax.numpy.zeros((8, cfg.seq_len), jax.numpy.int32)

    @eqx.filter_jit
    def step(model, opt_state, toks):
        loss, grads = eqx.filter_value_and_grad(lambda m: nn.lm_loss(m, toks, toks)[0])(model)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    start = time.perf_counter()
    step.lower(model, opt_state, toks).compile()
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
