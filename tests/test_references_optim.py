"""`make_optimizer` (clipping, AdamW, the decay mask) against the float64 AdamW of
`tests/references.py`, with its defaults and with every option given: three steps of random
gradients of a global norm of 1.5 (between the default clip, 1.0, and any larger), on a GPT-2
style model (biases, norms, embeddings: every decay flag has something to act on).

Errors are measured relative to how far each parameter moved: at most 1.4e-6 (fp32 rounding of
parameters of order 1), 4e-3 with a bf16 first moment; the tolerances are 1e-5 and 1e-2.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references as ref
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.train.optim import make_lr_schedule, make_optimizer
from helpers import TINY


def flat(tree) -> dict:
    return {par.path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def decays(name: str, embeddings: bool, norms_and_biases: bool) -> bool:
    """Which arrays weight decay applies to, by name: matrices of the linear layers; embedding
    tables, norm scales and biases only when asked."""
    if name.endswith("embed.weight"):
        return embeddings
    if "norm" in name or name.endswith(".bias"):
        return norms_and_biases
    return True


OPTIONS = {
    "defaults": ({}, dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0), False, False),
    "given": (dict(weight_decay=0.3, b1=0.8, b2=0.99, eps=1e-3, clip_norm=None, decay_embeddings=True,
                   decay_norms_and_biases=True),
              dict(b1=0.8, b2=0.99, eps=1e-3, weight_decay=0.3, clip=None), True, True),
    "bf16-mu": (dict(mu_dtype="bf16"), dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0), False, False),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_make_optimizer_is_clipped_adamw(case):
    kwargs, hyper, emb, nb = OPTIONS[case]
    params = eqx.filter(nn.GPT(TINY.replace(num_layers=1), key=jax.random.key(0)), eqx.is_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), 3 * len(leaves))
    grads = []
    for s in range(3):
        g = [jax.random.normal(keys[s * len(leaves) + i], x.shape) for i, x in enumerate(leaves)]
        norm = jnp.sqrt(sum(jnp.sum(x**2) for x in g))
        grads.append(jax.tree.unflatten(tree, [x * 1.5 / norm for x in g]))
    schedule = make_lr_schedule(0.05, total_steps=3, warmup_steps=1)
    opt = make_optimizer(schedule, **kwargs)
    state = opt.init(params)
    p = params
    for g in grads:
        updates, state = jax.jit(opt.update)(g, state, p)
        p = eqx.apply_updates(p, updates)
    names = flat(params)
    want = ref.adamw(names, [flat(g) for g in grads], lambda t: float(schedule(t)),
                     decays={k: decays(k, emb, nb) for k in names}, **hyper)
    got = flat(p)
    tol = 1e-2 if case == "bf16-mu" else 1e-5
    for k in names:
        step = np.max(np.abs(want[k] - names[k]))  # how far the parameter moved
        assert np.max(np.abs(got[k] - want[k])) <= tol * step, (case, k)
    mus = [x.dtype for x in jax.tree.leaves(state) if hasattr(x, "dtype") and x.ndim > 1]
    assert (jnp.bfloat16 in mus) == (case == "bf16-mu")


def test_expert_matrices_decay_by_default():
    """Arrays of modules other than `Linear` decay when they are matrices by their logical axes:
    an MoE layer's expert weights (`[layers, expert, embed, mlp]`) do, with the default flags."""
    import eqgpt
    from eqgpt.train.optim import decay_mask

    config = eqgpt.preset("moe-nano", vocab_size=64, num_layers=2, embed_dim=32, num_heads=2, seq_len=32)
    params = eqx.filter(nn.GPT(config, key=jax.random.key(0)), eqx.is_array)
    flags = flat(decay_mask(params))
    assert flags["blocks.mlp.experts.up"] and flags["blocks.mlp.experts.down"] and flags["blocks.mlp.router.weight"]
    assert not flags["blocks.mlp_norm.weight"] and not flags["tok_embed.weight"]
