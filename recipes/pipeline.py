"""Pipeline parallelism: GPipe, 1F1B or interleaved stages, with data parallelism beside it.

    .venv/bin/python recipes/pipeline.py                                  # pipeline=4,data=2, 1f1b, m=8
    .venv/bin/python recipes/pipeline.py --schedule interleaved --microbatches 8 --virtual-stages 2
    .venv/bin/python recipes/pipeline.py --mesh pipeline=2,data=2,tensor=2 --rules dp+tp

The model's 8 layers are cut into p stages (v chunks each when interleaved); the
embedding runs on the first stage, the norm, head and loss on the last. Prints
the schedule table, its bubble, the compiled step's temporary memory per device,
the losses of a short AdamW run, and the first loss of the same model on one device.
"""

from __future__ import annotations

import argparse

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import eqgpt  # noqa: E402
from _parallel_demo import text_batches  # first: 8 simulated CPU devices
from eqgpt import nn  # noqa: E402
from eqgpt import parallel as par  # noqa: E402
from eqgpt.parallel.pipeline import PP, pipeline_grad_fn  # noqa: E402
from eqgpt.profile import memory  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="pipeline=4,data=2")
    ap.add_argument("--rules", default="dp", help="strategy for the other axes: dp, fsdp, dp+tp, ...")
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per stage (interleaved)")
    ap.add_argument("--rows", type=int, default=2, help="rows per microbatch per data-parallel device")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    config = eqgpt.GPTConfig(vocab_size=256, seq_len=64, num_layers=8, num_heads=4, embed_dim=64)
    mesh = par.make_mesh(args.mesh)
    rules = par.preset_rules(args.rules) + PP  # the layer stack's `layers` axis over `pipeline`
    grad_fn = pipeline_grad_fn(mesh, args.schedule, args.microbatches,
                               virtual_stages=args.virtual_stages, rules=rules)
    print(grad_fn.schedule.table())
    d = mesh.shape["data"] * mesh.shape["fsdp"]
    batch_size = args.microbatches * args.rows * d

    placement = par.ShardedPlacement(mesh, rules)
    model = placement.init_model(lambda k: nn.GPT(config, key=k), jax.random.key(0))
    optimizer = optax.adamw(3e-3)
    opt_state = placement.init_opt_state(optimizer, model)

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        (loss, aux), grads = grad_fn(model, batch)  # [batch, seq + 1] tokens in
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    batches = [placement.batch(b) for b in text_batches(args.steps, batch_size, config.seq_len)]
    compiled = train_step.lower(model, opt_state, batches[0]).compile()
    temp = memory(compiled).temp_bytes
    print(f"{grad_fn.report()}\ncompiled step: {temp / 2**20:.2f} MiB temporary memory per device "
          f"(batch {batch_size} = {args.microbatches} microbatches x {args.rows} rows x {d} data-parallel)")
    # The same initial model on one device, without the pipeline, for comparison.
    single = jax.device_put(nn.map_constraints(model, lambda _p, _h: nn.NoConstraint()), jax.devices()[0])
    tokens = jax.device_put(batches[0], jax.devices()[0])
    first = eqx.filter_jit(nn.lm_loss)(single, tokens[:, :-1], tokens[:, 1:])[0]
    for i, batch in enumerate(batches):
        model, opt_state, loss = compiled(model, opt_state, batch)
        print(f"step {i}: loss {float(loss):.4f}")
    print(f"single-device loss of step 0: {float(first):.4f}")


if __name__ == "__main__":
    main()
