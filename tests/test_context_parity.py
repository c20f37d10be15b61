"""Context-parallel training equals one device: 5 AdamW steps, losses and parameters.

The single-device run and its batches come from `parallel_cases` (shared with the
other strategies' parity tests). Here the strategy has a `Context` part: the
model's attention kernel is swapped for ring or all-gather attention (its
parameter tree stays the plain model's), and the batch is put into zigzag order
once per step.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest

from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.parallel import Strategy
from eqgpt.parallel.context import (
    Context,
    ContextKernel,
    context_kernels,
    context_rules,
    strip_context_attention,
    use_context_attention,
)
from helpers import assert_same_training
from parallel_cases import OPTIMIZER, arrays, reference_model, reference_run, train

CASES = [
    # (model, mesh, base strategy, kernel); ring over context=4,data=2 and Ulysses over context=2,data=4
    # are compared leaf by leaf at the first step in test_gradient_parity.
    ("gpt", "context=2,tensor=2,fsdp=2", "fsdp+tp", "ring"),
    ("llama", "context=2,tensor=2,fsdp=2", "fsdp+tp", "allgather"),
]


@functools.cache
def context_run(name: str, mesh_spec: str, base: str, impl: str):
    strategy = Strategy(par.make_mesh(mesh_spec), base, parts=(Context(impl, block=4),))
    model = strategy.place_model(reference_model(name))
    opt_state = strategy.place_opt_state(OPTIMIZER.init(eqx.filter(model, eqx.is_array)), model)
    losses, state, compiled = train(strategy, model, opt_state)
    # The arrays of the context-parallel model itself: the same paths as the plain model's.
    return losses, arrays(state.model), compiled, state.model


@pytest.mark.parametrize("name, mesh, base, impl", CASES, ids=[f"{m}:{b}:{i}:{n}" for n, m, b, i in CASES])
def test_context_parallel_trains_like_one_device(name, mesh, base, impl):
    out = context_run(name, mesh, base, impl)
    assert_same_training(reference_run(name), out)
    model = out[3]
    assert isinstance(model.blocks.attn.kernel, ContextKernel) and model.blocks.attn.kernel.impl == impl
    assert strip_context_attention(model).blocks.attn.kernel == reference_model(name).blocks.attn.kernel
    spec = model.blocks.attn.q_proj.weight.sharding.spec
    if "fsdp" in base:
        assert "fsdp" in spec and "tensor" in spec


def test_every_gradient_is_summed_over_the_data_devices():
    """Each weight's gradient is a sum over the tokens of all data x context devices.

    The parity test above proves the sum; here the compiled step shows the data
    half of it: all-reduces over `data` (groups of 2) or over all 8 devices cover
    every parameter byte. (Over `context` the partitioner may reduce the weight
    gradients or contract the sequence on gathered activations: either is exact.)
    """
    from eqgpt.profile import collectives

    compiled = context_run("llama", "context=4,data=2", "dp", "ring")[2]
    reduced: dict[int, int] = {}
    for r in collectives(compiled):
        if r.effective_kind == "all-reduce" and r.phase == "backward":
            reduced[r.group_size] = reduced.get(r.group_size, 0) + r.total_bytes
    params = sum(x.size * x.dtype.itemsize
                 for x in jax.tree.leaves(eqx.filter(reference_model("llama"), eqx.is_array)))
    assert reduced.get(2, 0) + reduced.get(8, 0) >= params


def test_grad_fn_checks_its_inputs_before_compiling():
    strategy = Strategy(par.make_mesh("context=4,data=2"), "dp", parts=(Context("ring"),))
    grad_fn = strategy.grad_fn()
    plain = reference_model("llama")
    bad = Batch.from_windows(np.zeros((8, 37), np.int32))  # 36 is not a multiple of 2 * 4
    with pytest.raises(ValueError, match="divisible by 8"):
        jax.eval_shape(grad_fn, use_context_attention(plain, strategy.mesh), bad)
    with pytest.raises(ValueError, match="use_context_attention"):
        jax.eval_shape(grad_fn, plain, Batch.from_windows(np.zeros((8, 33), np.int32)))
    with pytest.raises(ValueError, match="'tp' rather than 'sp'"):
        context_rules("dp+sp")


def test_context_attention_keeps_the_parameter_tree():
    """Installing context attention swaps a static kernel: the same array paths, the very
    same array objects; the replaced kernel (a user's callable too) comes back on strip."""
    plain = reference_model("gpt")
    mesh = par.make_mesh("context=4,data=2")
    flat = lambda m: jax.tree_util.tree_flatten_with_path(eqx.filter(m, eqx.is_array))[0]  # noqa: E731
    cp = use_context_attention(plain, mesh, Context("allgather", block=4))
    assert [par.path_str(p) for p, _ in flat(cp)] == [par.path_str(p) for p, _ in flat(plain)]
    assert all(a is b for (_, a), (_, b) in zip(flat(cp), flat(plain), strict=True))
    (kernel,) = context_kernels(cp)
    assert (kernel.impl, kernel.block_q, kernel.replaces) == ("allgather", 4, plain.blocks.attn.kernel)
    again = use_context_attention(cp, mesh, "ring")  # over an installed one: still remembers the original
    assert context_kernels(again)[0].impl == "ring" and context_kernels(again)[0].replaces == plain.blocks.attn.kernel
    stripped = strip_context_attention(again)
    assert stripped.blocks.attn.kernel == plain.blocks.attn.kernel and context_kernels(stripped) == []

    def my_kernel(q, k, v, **kw):
        return q

    mine = eqx.tree_at(lambda m: m.blocks.attn, plain, plain.blocks.attn.with_kernel(my_kernel))
    assert strip_context_attention(use_context_attention(mine, mesh)).blocks.attn.kernel is my_kernel
    with pytest.raises(ValueError, match="no eqgpt.nn.Attention"):
        use_context_attention({"w": np.zeros(3)}, mesh)
