"""The composed automatic strategies train exactly like one device over several steps.

Each single axis (dp, fsdp, tp, sp) is proven at its first step's gradients, leaf by
leaf, in test_gradient_parity; here the compositions that hold them all (dp+fsdp+tp
and fsdp+sp) run on. Each case trains 5 AdamW steps (fp32, lr 1e-3) from the single-device run's
initial weights on the same 5 batches, on the 8 simulated CPU devices, and
compares per-step losses (rtol 1e-5) and all final parameters (rtol 1e-5,
atol 1e-6; see `test_k_bias_is_noise` for the one looser bound).
"""

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_same_training
from parallel_cases import CONFIGS, reference_run, sharded_run

CASES = [
    ("data=2,fsdp=2,tensor=2", "dp+fsdp+tp"),
    ("fsdp=4,tensor=2", "fsdp+sp"),
]

@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("mesh, strategy", CASES, ids=[f"{m}:{s}" for m, s in CASES])
def test_strategy_trains_like_one_device(name, mesh, strategy):
    out = sharded_run(name, mesh, strategy)
    assert_same_training(reference_run(name), out)
    model = out[4]
    # The parameters really are distributed as the strategy says.
    q = model.blocks.attn.q_proj.weight.sharding.spec
    if "fsdp" in strategy:
        assert "fsdp" in q
    if "tp" in strategy or "sp" in strategy:
        assert "tensor" in q
    if strategy == "dp":
        assert all(e is None for e in q)


def test_per_module_overrides_train_like_one_device():
    """Attention Megatron-split on `tensor` (and FSDP), the MLP FSDP only, and the
    token table split over vocab on `tensor`: a mixed layout, initialised directly
    sharded by `ShardedPlacement.init_model`."""
    out = sharded_run("gpt", "fsdp=4,tensor=2", "fsdp", "attn_tp_mlp_fsdp_embed_vocab", init_directly=True)
    assert_same_training(reference_run("gpt"), out)
    model = out[4]
    mesh = out[3].mesh

    def placed_as(x, *spec):
        return x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)

    assert placed_as(model.blocks.attn.q_proj.weight, None, "fsdp", "tensor")
    assert placed_as(model.blocks.mlp.up.weight, None, "fsdp", None)
    assert placed_as(model.tok_embed.weight, "tensor", None)
    assert model.blocks.attn.shard.rules.activations["heads"] == ("tensor",)
    assert "heads" not in model.blocks.mlp.shard.rules.activations


def test_k_bias_is_noise():
    """The looser bound above is for a parameter whose true gradient is zero."""
    losses, arrays, *_ = reference_run("gpt")
    k_bias = arrays["blocks.attn.k_proj.bias"]
    assert np.max(np.abs(k_bias)) < 1e-4 < np.max(np.abs(arrays["blocks.attn.q_proj.bias"]))
