"""Cross-entropy with z-loss (`chunked_cross_entropy`, the fused head, `lm_loss`) and the
ZeRO-2 gradient shard against the independent NumPy definitions (`tests/references.py`).

fp32 against float64: values and gradients are within 7e-7 (relative to the largest
entry), so the tolerance is rel 1e-5.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqgpt
import references as ref
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.nn.loss import chunked_cross_entropy, head_loss_sums
from eqgpt.parallel.zero import manual_zero_grad_fn
from eqgpt.precision import Policy
from helpers import UnfusedHead, assert_within

B, T, D, V = 2, 13, 8, 11  # 13 positions: chunks of 4 pad the last one
TOL = 1e-5
Z = 0.1  # a z-loss weight large enough to matter


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def data():
    ks = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(ks[0], (B, T, D))
    weight = 2 * jax.random.normal(ks[1], (V, D))  # logits of scale ~5: a non-trivial lse
    targets = jax.random.randint(ks[2], (B, T), 0, V)
    mask = (jax.random.uniform(ks[3], (B, T)) < 0.7).astype(jnp.float32)
    return hidden, weight, targets, mask


def chunked(hidden, weight, targets, mask):
    loss, aux = chunked_cross_entropy(lambda h: h @ weight.T, hidden, targets, loss_mask=mask, chunk_size=4,
                                      z_loss=Z)
    return loss, aux


def fused(hidden, weight, targets, mask):
    total, (nll, z, count) = head_loss_sums(hidden, weight, targets, loss_mask=mask, chunk_size=4, z_loss=Z)
    return total / count, {"nll": nll / count, "z_loss": z / count}


@pytest.mark.parametrize("loss_fn", [chunked, fused])
def test_cross_entropy_with_z_loss(loss_fn):
    hidden, weight, targets, mask = data()
    (loss, aux), (d_hidden, d_weight) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(
        hidden, weight, targets, mask)
    h64, w64 = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
    logits = h64 @ w64.T
    want, nll, z = ref.cross_entropy(logits, targets, mask, Z)
    assert_within(rel_err(loss, want), TOL, "loss")
    assert_within(rel_err(aux["nll"], nll), TOL, "nll")
    assert_within(rel_err(aux["z_loss"], z), TOL, "z-loss")
    d_logits = ref.cross_entropy_logit_grad(logits, targets, mask, Z)
    assert_within(rel_err(d_hidden, d_logits @ w64), TOL)
    assert_within(rel_err(d_weight, np.einsum("btv,btd->vd", d_logits, h64)), TOL)


CONFIG = eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=2, embed_dim=16)


def test_lm_loss_z_loss():
    model = nn.GPT(CONFIG, key=jax.random.key(0))
    windows = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    tokens, targets = windows[:, :-1], windows[:, 1:]
    mask = jnp.ones((2, 16)).at[1, :5].set(0.0)
    (loss, aux), hidden = eqx.filter_jit(
        lambda m: (nn.lm_loss(m, tokens, targets, loss_mask=mask, z_loss=Z), m.features(tokens)))(model)
    logits = np.asarray(hidden, np.float64) @ np.asarray(model.head_matrix(), np.float64).T
    want, nll, z = ref.cross_entropy(logits, targets, mask, Z)
    assert_within(rel_err(loss, want), TOL, "loss")
    assert_within(rel_err(aux["nll"], nll), TOL, "nll")
    assert_within(rel_err(aux["z_loss"], z), TOL, "z-loss")



@pytest.mark.parametrize("head", ["unfused", "fused"])
def test_zero2_shard_is_the_block_of_the_averaged_gradient(head):
    """Manual ZeRO-2 over `data=8`: device i holds block i (along the first dimension of size
    divisible by 8) of the mean of the 8 replicas' gradients; other arrays whole."""
    config = eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=1, num_heads=2, embed_dim=16, tie_embeddings=False)
    model = nn.GPT(config, key=jax.random.key(0))
    model = UnfusedHead(model) if head == "unfused" else model
    mesh = par.make_mesh("data=8")
    windows = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, 64))
    _, grads = jax.jit(manual_zero_grad_fn(mesh, stage=2, policy=Policy()))(model, Batch.from_windows(windows))

    def replica_grad(row):  # one replica's gradient of its mean loss (one row each)
        def loss(m):
            return nn.lm_loss(m, row[None, :-1], row[None, 1:])[0]
        return eqx.filter_grad(loss)(model)

    replicas = jax.jit(jax.vmap(replica_grad))(jnp.asarray(windows))
    devices = list(mesh.devices.flat)
    for got, stacked in zip(jax.tree.leaves(eqx.filter(grads, eqx.is_array)),
                            jax.tree.leaves(eqx.filter(replicas, eqx.is_array)), strict=True):
        dim = next((d for d, size in enumerate(got.shape) if size % 8 == 0), None)
        whole = np.mean(np.asarray(stacked, np.float64), axis=0)
        for shard in got.addressable_shards:
            i = devices.index(shard.device)
            if dim is None:
                want = whole
            else:
                want = ref.zero2_shard(list(np.asarray(stacked)), i, dim)
                block = got.shape[dim] // 8
                assert shard.index[dim] == slice(i * block, (i + 1) * block)
            # Relative to the array's largest entry; the key bias's gradient is 0 up to rounding
            # (~1e-12: softmax ignores a shift shared by all keys), hence the absolute 1e-9.
            assert np.max(np.abs(shard.data - want)) <= TOL * np.max(np.abs(whole)) + 1e-9
