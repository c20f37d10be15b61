"""The Pallas splash kernel (interpret mode on CPU) and `auto`, against definitions written here.

The references build their masks in NumPy from the definitions (causal `j <= i`, sliding
window `i - window < j <= i`, documents: same segment id) and compute softmax attention
densely in plain `jnp`, sharing nothing with `eqgpt.nn.mask` or the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqgpt
from eqgpt.nn.kernels import auto_kernel_name, get_kernel
from eqgpt.nn.mask import CausalMask, DocumentMask, FullMask, Mask, SlidingWindowMask

T, B = 256, 2


def numpy_mask(kind: str, t: int, window: int | None = None, seg: np.ndarray | None = None) -> np.ndarray:
    """`[b, t, t]` booleans from the definitions: causal j <= i; sliding i - window < j <= i; full."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = {"causal": j <= i, "sliding": (j <= i) & (j > i - (window or 0)), "full": np.ones((t, t), bool)}[kind]
    allowed = np.broadcast_to(allowed, (B, t, t))
    if seg is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])
    return allowed


def dense_attention(q, k, v, allowed):
    """Softmax attention, repeating kv heads for GQA; fp32."""
    h, g = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(jnp.asarray(allowed)[:, None], scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


def inputs(heads=4, kv_heads=2, d=64):
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (B, T, heads, d)), jax.random.normal(ks[1], (B, T, kv_heads, d)),
            jax.random.normal(ks[2], (B, T, kv_heads, d)), jax.random.normal(ks[3], (B, T, heads, d)))


SEG = np.concatenate([np.zeros((B, 100), np.int32), np.ones((B, 60), np.int32), np.full((B, 96), 2, np.int32)], 1)
CASES = {
    "causal": (CausalMask(), numpy_mask("causal", T), None),
    "sliding": (SlidingWindowMask(37), numpy_mask("sliding", T, 37), None),
    "full": (FullMask(), numpy_mask("full", T), None),
    "document": (DocumentMask(), numpy_mask("causal", T, seg=SEG), SEG),
    "sliding-document": (DocumentMask(SlidingWindowMask(50)), numpy_mask("sliding", T, 50, SEG), SEG),
}


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_the_dense_definition_values_and_gradients(case, heads, kv_heads):
    mask, allowed, seg = CASES[case]
    q, k, v, ct = inputs(heads, kv_heads)
    pos = jnp.arange(T)
    seg = None if seg is None else jnp.asarray(seg)

    def splash(q, k, v):
        out = get_kernel("splash")(q, k, v, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg)
        return jnp.sum(out * ct), out

    def dense(q, k, v):
        out = dense_attention(q, k, v, allowed)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.value_and_grad(splash, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, want), want_grads = jax.value_and_grad(dense, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    # fp32 at highest matmul precision: measured differences are <= 6e-7 of the largest value.
    for got, ref in ((out, want), *zip(grads, want_grads, strict=True)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-backward", "two-backward-kernels"])
def test_splash_over_several_blocks_equals_the_definition(fused, monkeypatch):
    """Blocks of 128 over 256 positions: the kernel skips and splits blocks, and the fused backward
    sums dq over key blocks; values and gradients still equal the dense definition."""
    from eqgpt.nn.kernels import splash

    monkeypatch.setitem(splash.BLOCK_TABLE, (T, 64, "float32"), splash.Blocks(128, 128, fused))
    mask, allowed, seg = CASES["sliding-document"]
    q, k, v, ct = inputs(4, 2)
    pos, seg = jnp.arange(T), jnp.asarray(seg)
    got = jax.value_and_grad(lambda q, k, v: jnp.sum(get_kernel("splash")(
        q, k, v, mask=mask, q_pos=pos, k_pos=pos, q_seg=seg, k_seg=seg) * ct), argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(lambda q, k, v: jnp.sum(dense_attention(q, k, v, allowed) * ct),
                              argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_sliding_window_admits_exactly_window_keys():
    """One key too many (`i - window <= j`) changes the output: the definition is what is tested."""
    q, k, v, _ = inputs()
    pos = jnp.arange(T)
    out = get_kernel("splash")(q, k, v, mask=SlidingWindowMask(37), q_pos=pos, k_pos=pos)
    too_wide = dense_attention(q, k, v, numpy_mask("sliding", T, 38))
    assert float(jnp.max(jnp.abs(out - too_wide))) > 1e-2
    np.testing.assert_allclose(out, dense_attention(q, k, v, numpy_mask("sliding", T, 37)), rtol=1e-5, atol=1e-5)


def test_splash_refuses_lengths_and_masks_it_has_no_form_of():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="multiples of 128"):
        get_kernel("splash")(q[:, :100], k[:, :100], v[:, :100], mask=CausalMask(), q_pos=jnp.arange(100),
                             k_pos=jnp.arange(100))

    class Strange(Mask):  # a mask splash has no form of
        def _allowed(self, q_pos, k_pos):
            return k_pos != q_pos

    with pytest.raises(ValueError, match="no form of Strange"):
        get_kernel("splash")(q, k, v, mask=Strange(), q_pos=jnp.arange(T), k_pos=jnp.arange(T))


def test_auto_picks_flash_on_tpu_cudnn_on_gpu_and_by_length_on_cpu():
    bf16 = jnp.bfloat16
    assert auto_kernel_name(CausalMask(), 1024, 1024, bf16, platform="tpu") == "flash"
    assert auto_kernel_name(CausalMask(), 4096, 4096, bf16, platform="tpu") == "flash"
    assert auto_kernel_name(CausalMask(), 512, 512, bf16, platform="tpu") == "flash"
    assert auto_kernel_name(CausalMask(), 256, 256, bf16, platform="tpu") == "splash"  # flash unmeasured there
    assert auto_kernel_name(CausalMask(), 8192, 8192, bf16, platform="tpu") == "splash"
    assert auto_kernel_name(CausalMask(), 1000, 1000, bf16, platform="tpu") == "blockwise"  # not a multiple of 128
    assert auto_kernel_name(CausalMask(), 1024, 1024, bf16, platform="gpu") == "cudnn"
    assert auto_kernel_name(CausalMask(), 1024, 1024, jnp.float32, platform="gpu") == "blockwise"
    cpu = eqgpt.nn.kernels.CPU_BLOCKWISE_FROM
    assert auto_kernel_name(CausalMask(), 128, 128, jnp.float32, platform="cpu") == "reference"
    assert auto_kernel_name(CausalMask(), cpu, cpu, jnp.float32, platform="cpu") == "blockwise"
    assert eqgpt.GPTConfig().attention_kernel == "auto"


def _pallas_grads(kernel, strategy):
    """fp32 loss and gradient leaves of a 2-layer nano GPT (splash with grouped kv heads, flash
    with as many as queries) on one fixed batch of 8 rows, under `strategy`. Two layers: a
    pipeline of 2 stages still holds one each; in interpret mode the layer count drives the cost."""
    import equinox as eqx

    from eqgpt.data.batch import Batch
    from eqgpt.nn import GPT

    cfg = eqgpt.preset("nano", attention_kernel=kernel, num_layers=2,
                       num_kv_heads=2 if kernel == "splash" else None)
    windows = np.random.default_rng(0).integers(0, 256, (8, cfg.seq_len + 1)).astype(np.int32)
    model = strategy.init_model(lambda key: GPT(cfg, key=key), jax.random.key(0))
    batch = strategy.batch(Batch.from_windows(windows))
    (loss, _), g = eqx.filter_jit(strategy.grad_fn(model_like=model))(model, batch)
    return float(loss), [np.asarray(x) for x in jax.tree.leaves(g)]


@functools.cache
def _one_device_grads(kernel):
    """The one-device reference, computed once per kernel for every mesh case."""
    from eqgpt.train import Strategy

    return _pallas_grads(kernel, Strategy())


@pytest.mark.parametrize("kernel,mesh,rules,parts", [
    ("splash", "fsdp=4,tensor=2", "fsdp+tp", {}), ("splash", "data=8", "dp", {}),
    ("splash", "pipeline=2,data=4", "dp", {"pipeline": "1f1b", "microbatches": 2}),
    ("flash", "fsdp=4,tensor=2", "fsdp+tp", {}),
    ("flash", "pipeline=2,data=4", "dp", {"pipeline": "1f1b", "microbatches": 2})],
    ids=["fsdp4-tp2", "dp8", "pipeline2-dp4", "flash-fsdp4-tp2", "flash-pipeline2-dp4"])
def test_pallas_gradients_under_a_mesh_equal_one_device(kernel, mesh, rules, parts):
    """The Pallas kernels map themselves over the mesh (GSPMD cannot split a Pallas call), or run
    inside the pipeline's type-checked shard_map: fp32 gradients, leaf by leaf, equal one device's
    (measured differences <= 4e-8)."""
    from eqgpt.parallel import ParallelFlags

    loss1, g1 = _one_device_grads(kernel)
    loss8, g8 = _pallas_grads(kernel, ParallelFlags.parse(mesh, rules, **parts))
    assert abs(loss8 - loss1) < 1e-5
    for a, b in zip(g8, g1, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_splash_inside_a_shard_map_that_checks_types_equals_outside():
    """Inside `shard_map` (check_vma on) the kernel runs unchecked and types its results itself.
    k and v are invariant over `data` while q varies: their gradients must still be summed over
    `data` (a missing sum would give 1/8 of them)."""
    from jax.sharding import PartitionSpec as P

    from eqgpt.parallel.mesh import make_mesh

    mesh = make_mesh("data=8")
    q, k, v, ct = inputs()
    pos = jnp.arange(T)

    def splash(q, k, v):
        return get_kernel("splash")(q, k, v, mask=CausalMask(), q_pos=pos, k_pos=pos)

    mapped = jax.shard_map(splash, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P("data"),
                           axis_names={"data"})  # a nested shard_map needs an automatic axis left
    rows = lambda x: jnp.tile(x, (8, 1, 1, 1))  # noqa: E731  (the one k, v row every query row sees)
    dense = lambda q, k, v: dense_attention(q, rows(k), rows(v), numpy_mask("causal", T)[:1])  # noqa: E731
    q, ct = jnp.concatenate([q] * 4), jnp.concatenate([ct] * 4)
    k, v = k[:1], v[:1]
    got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(mapped(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: jnp.sum(dense(*a) * ct), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    assert auto_kernel_name(CausalMask(), T, T, jnp.bfloat16, platform="tpu") == "splash"
