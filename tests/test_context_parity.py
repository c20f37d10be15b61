"""Context-parallel training equals one device: 5 AdamW steps, losses and parameters.

The single-device run and its batches come from `parallel_cases` (shared with the
other strategies' parity tests). Here the model has ring or all-gather attention
installed, the batch is put into zigzag order once per step, and the gradient is
`context_grad_fn`'s.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from eqgpt import parallel as par
from eqgpt.parallel.context import (
    ContextAttention,
    context_grad_fn,
    context_rules,
    strip_context_attention,
    use_context_attention,
)
from parallel_cases import OPTIMIZER, OPTIONS, arrays, batches, reference_model, reference_run

# As in test_parallel_parity: GPT-2's key bias has an exact gradient of zero (softmax
# ignores a per-query constant), so its values are Adam-amplified rounding noise.
NOISE_ONLY = {"blocks.attn.k_proj.bias": 2e-5}


def assert_same_training(ref, out):
    """Per-step losses within rtol 1e-5, every final parameter within rtol 1e-5, atol 1e-6."""
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=0)
    assert len(out[0]) == 5 and ref[0][-1] < ref[0][0]
    assert out[1].keys() == ref[1].keys()
    for path, want in ref[1].items():
        np.testing.assert_allclose(out[1][path], want, rtol=1e-5, atol=NOISE_ONLY.get(path, 1e-6), err_msg=path)

CASES = [
    # (model, mesh, base strategy, kernel)
    ("llama", "context=4,data=2", "dp", "ring"),
    ("gpt", "context=2,tensor=2,fsdp=2", "fsdp+tp", "ring"),
    ("llama", "context=2,tensor=2,fsdp=2", "fsdp+tp", "allgather"),
]


@functools.cache
def context_run(name: str, mesh_spec: str, base: str, impl: str):
    mesh = par.make_mesh(mesh_spec)
    placement = par.ShardedPlacement(mesh, context_rules(base))
    model = use_context_attention(reference_model(name), mesh, impl, block_q=4, block_k=4)
    model = placement.place_model(model)
    opt_state = placement.place_opt_state(OPTIMIZER.init(eqx.filter(model, eqx.is_array)), model)
    grad_fn = context_grad_fn(mesh, ordering="zigzag")

    @eqx.filter_jit
    def step(model, opt_state, batch):
        (loss, _), grads = grad_fn(model, batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    rows = NamedSharding(mesh, placement.rules.spec(("batch",), "activations", mesh=mesh))
    data = [jax.device_put({"tokens": x, "targets": y}, rows) for x, y in batches()]
    compiled = step.lower(model, opt_state, data[0]).compile(OPTIONS)
    losses = []
    for batch in data:
        model, opt_state, loss = compiled(model, opt_state, batch)
        losses.append(float(loss))
    return losses, arrays(strip_context_attention(model)), compiled, model


@pytest.mark.parametrize("name, mesh, base, impl", CASES, ids=[f"{m}:{b}:{i}:{n}" for n, m, b, i in CASES])
def test_context_parallel_trains_like_one_device(name, mesh, base, impl):
    out = context_run(name, mesh, base, impl)
    assert_same_training(reference_run(name), out)
    model = out[3]
    assert isinstance(model.blocks.attn, ContextAttention)
    spec = model.blocks.attn.attn.q_proj.weight.sharding.spec
    if "fsdp" in base:
        assert "fsdp" in spec and "tensor" in spec


def test_every_gradient_is_summed_over_data_and_context():
    """Each weight's gradient is a sum over the tokens of all data x context devices.

    The partitioner emits it per layer as an all-reduce over `context` (groups of 4)
    and one over `data` (groups of 2), and for the embedding as one over all 8; each
    path covers all parameter bytes.
    """
    from eqgpt.profile import collectives

    compiled = context_run("llama", "context=4,data=2", "dp", "ring")[2]
    reduced = {2: 0, 4: 0, 8: 0}
    for r in collectives(compiled):
        if r.effective_kind == "all-reduce" and r.phase == "backward":
            reduced[r.group_size] = reduced.get(r.group_size, 0) + r.total_bytes
    params = sum(x.size * x.dtype.itemsize
                 for x in jax.tree.leaves(eqx.filter(reference_model("llama"), eqx.is_array)))
    assert reduced[4] + reduced[8] >= params  # over context
    assert reduced[2] + reduced[8] >= params  # over data


def test_grad_fn_checks_its_inputs_before_compiling():
    mesh = par.make_mesh("context=4,data=2")
    grad_fn = context_grad_fn(mesh)
    plain = reference_model("llama")
    tokens = np.zeros((8, 36), np.int32)  # 36 is not a multiple of 2 * 4
    with pytest.raises(ValueError, match="divisible by 8"):
        jax.eval_shape(grad_fn, use_context_attention(plain, mesh), {"tokens": tokens, "targets": tokens})
    tokens = np.zeros((8, 32), np.int32)
    with pytest.raises(ValueError, match="use_context_attention"):
        jax.eval_shape(grad_fn, plain, {"tokens": tokens, "targets": tokens})
    with pytest.raises(ValueError, match="'tp' rather than 'sp'"):
        context_rules("dp+sp")
