"""Single-device model components: sizes, errors, scan, remat, causality, loss."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError

import eqgpt
from eqgpt import nn
from helpers import TINY, TINY_LLAMA, assert_trees_close, tokens


def n_params(model):
    return sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "shape"))


def test_gpt2_small_has_124m_parameters():
    """GPT-2's count without padding; the preset's 47 padding rows of the token table add 47 x 768."""
    count = lambda c: n_params(eqx.filter_eval_shape(lambda: nn.GPT(c, key=jax.random.key(0))))  # noqa: E731
    assert count(eqgpt.preset("gpt2-small", vocab_pad_multiple=1)) == 124_439_808
    assert count(eqgpt.preset("gpt2-small")) == 124_439_808 + 47 * 768 == 124_475_904


def test_gpt2_small_moe_is_active_like_gpt2_small():
    """8 experts of width 1536, top-2: per token the MLP's 2 x 768 x 3072 weights, plus the router."""
    from eqgpt.profile.flops import matmul_params

    router = 12 * 768 * 8
    assert matmul_params(eqgpt.preset("gpt2-small-moe")) == matmul_params(eqgpt.preset("gpt2-small")) + router


@pytest.mark.parametrize("name", sorted(eqgpt.PRESETS))
def test_every_preset_builds_abstractly(name):
    model = eqx.filter_eval_shape(lambda: nn.GPT(eqgpt.preset(name), key=jax.random.key(0)))
    assert n_params(model) > 0


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(embed_dim=30, num_heads=4), "divisible by num_heads"),
        (dict(num_heads=4, num_kv_heads=3), "must divide num_heads"),
        (dict(mask="sliding"), "window"),
        (dict(num_layers=0), "positive"),
    ],
)
def test_bad_config_raises_value_error(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_sequence_longer_than_positions_raises():
    model = nn.GPT(TINY, key=jax.random.key(0))
    with pytest.raises(ValueError, match="longer than the model's seq_len"):
        model(jnp.zeros((1, TINY.seq_len + 1), jnp.int32))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="Unknown attention kernel"):
        nn.Attention(32, 4, kernel="flashy", key=jax.random.key(0))
    with pytest.raises(ValueError, match="Unknown remat"):
        nn.GPT(TINY.replace(remat="sometimes"), key=jax.random.key(0))


def test_shape_error_is_a_typecheck_error():
    attn = nn.Attention(32, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="seq=6"):  # segment ids for 7 tokens, input of 6
        attn(jnp.ones((2, 6, 32)), segment_ids=jnp.zeros((2, 7), jnp.int32))
    with pytest.raises(TypeCheckError, match="batch seq embed"):
        attn(jnp.ones((6, 32)))
    model = nn.GPT(TINY, key=jax.random.key(0))
    with pytest.raises(TypeCheckError):
        model(jnp.zeros((16,), jnp.int32))  # missing the batch axis


def test_every_array_has_logical_axes_of_its_rank():
    for cfg in (TINY, TINY_LLAMA):
        model = nn.GPT(cfg, key=jax.random.key(0))
        arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
        axes = jax.tree.leaves(nn.logical_axes(model), is_leaf=lambda x: isinstance(x, nn.LogicalAxes))
        assert len(arrays) == len(axes)
        for arr, names in zip(arrays, axes, strict=True):
            assert isinstance(names, nn.LogicalAxes) and len(names.names) == arr.ndim
            assert set(names.names) <= set(nn.axes.WEIGHT_AXES) | {None}


@pytest.mark.parametrize("cfg", [TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_scanned_stack_equals_blocks_applied_one_by_one(cfg):
    model = nn.GPT(cfg, key=jax.random.key(0))
    toks = tokens(jax.random.key(1))
    pos = jnp.arange(toks.shape[1])
    x = model.embed(toks, pos)
    scanned = model.run_blocks(x, pos)
    dynamic, static = eqx.partition(model.blocks, eqx.is_array)
    h = x
    for i in range(cfg.num_layers):
        block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static)
        h = block(h, positions=pos)
    np.testing.assert_allclose(scanned, h, rtol=1e-5, atol=1e-6)


@functools.cache
def _remat_grads(policy):
    toks = tokens(jax.random.key(1))
    model = nn.GPT(TINY_LLAMA.replace(remat=policy), key=jax.random.key(0))
    loss = lambda m: nn.lm_loss(m, toks, jnp.roll(toks, -1, 1))[0]  # noqa: E731
    return eqx.filter_jit(eqx.filter_grad(loss))(model)


@pytest.mark.parametrize(
    "remat", ["full", "dots", "names:query_proj,key_proj,value_proj,mlp_in", "offload:attn_out,mlp_out"]
)
def test_remat_policies_give_the_same_gradients(remat):
    assert_trees_close(_remat_grads("none"), _remat_grads(remat), rtol=1e-5, atol=1e-7)


def test_with_fields_changes_the_named_fields_and_shares_the_rest():
    from eqgpt.tree import with_fields

    layer = nn.Linear(4, 3, axes=("embed", "mlp"), key=jax.random.key(0))
    quant = object()  # any value: with_fields runs no __init__ and no check
    new = with_fields(layer, quant=quant)
    assert new.quant is quant and new.weight is layer.weight and layer.quant is not quant
    with pytest.raises(TypeError, match=r"Linear has no fields \['quantize'\]"):
        with_fields(layer, quantize=None)


def test_unrolled_layers_equal_the_scan_and_leave_no_loop():
    toks = tokens(jax.random.key(1))
    loss = lambda m: nn.lm_loss(m, toks, jnp.roll(toks, -1, 1))[0]  # noqa: E731
    unrolled = nn.GPT(TINY_LLAMA.replace(scan_layers=False), key=jax.random.key(0))
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l_scan, g_scan), (l_unrolled, g_unrolled) = step(nn.GPT(TINY_LLAMA, key=jax.random.key(0))), step(unrolled)
    np.testing.assert_allclose(l_unrolled, l_scan, rtol=1e-6)
    assert_trees_close(g_unrolled, g_scan, rtol=1e-5, atol=1e-7)
    # XLA:CPU's loop emitters run a scatter (the embedding's gradient) as a loop of its own: not a layer loop.
    loops = lambda m: [x for x in step.lower(m).compile().compiled.as_text().splitlines()  # noqa: E731
                       if " while(" in x and "scatter" not in x]
    assert not loops(unrolled)
    assert loops(nn.GPT(TINY_LLAMA, key=jax.random.key(0)))
    scanned = unrolled.scanned()  # validation's and sampling's model: the same arrays, in a loop
    assert scanned.config.scan_layers and scanned.blocks is unrolled.blocks and loops(scanned)
    # Two layers per scan iteration (scan_unroll=2): the same loss and gradients.
    l_two, g_two = step(nn.GPT(TINY_LLAMA.replace(scan_unroll=2), key=jax.random.key(0)))
    np.testing.assert_allclose(l_two, l_scan, rtol=1e-6)
    assert_trees_close(g_two, g_scan, rtol=1e-5, atol=1e-7)



@pytest.mark.parametrize("cfg", [TINY, TINY_LLAMA, eqgpt.preset("moe-nano")], ids=["gpt2", "llama", "moe"])
def test_layers_created_inside_jit_are_drawn_one_at_a_time_with_vmaps_values(cfg):
    """Traced, `stack_layers` draws the layers in a loop (XLA:TPU compiles that far faster than drawing
    every layer at once): the same arrays, bit for bit, as `vmap` traced, and the same modules."""
    from eqgpt.nn.gpt import make_block, stack_layers

    make = lambda k: make_block(cfg, key=k)  # noqa: E731
    keys = jax.random.split(jax.random.key(3), cfg.num_layers)
    looped = jax.jit(lambda ks: eqx.filter(stack_layers(make, ks), eqx.is_array))
    vmapped = jax.jit(lambda ks: eqx.filter(eqx.filter_vmap(make)(ks), eqx.is_array))
    for a, b in zip(jax.tree.leaves(looped(keys)), jax.tree.leaves(vmapped(keys)), strict=True):
        np.testing.assert_array_equal(a, b)
    loops = lambda f: f.lower(keys).as_text().count("stablehlo.while")  # noqa: E731
    assert loops(looped) == loops(vmapped) + 1  # the loop over layers
    eager = nn.GPT(cfg, key=jax.random.key(3))  # vmap, op by op: XLA's fusions round the last bit otherwise
    traced = eqx.filter_jit(lambda k: nn.GPT(cfg, key=k))(jax.random.key(3))
    assert jax.tree.structure(traced) == jax.tree.structure(eager)
    assert_trees_close(traced, eager, rtol=1e-6, atol=1e-8)


def test_remat_full_recomputes_in_the_backward_and_keeps_fewer_temporaries():
    """The compiled gradient, not its jaxpr: `full` runs the blocks' forward matmuls again in the
    backward (more dots than `none`, whose loss recomputes nothing: the fused head) and keeps fewer
    temporaries; `minimal` saves the projections' outputs, so it recomputes fewer."""
    from eqgpt.profile.memory import memory

    toks = tokens(jax.random.key(1), batch=8, seq=32)

    def compiled(remat):
        model = nn.GPT(TINY.replace(remat=remat, scan_layers=True), key=jax.random.key(0))
        grad = eqx.filter_jit(eqx.filter_grad(lambda m: nn.lm_loss(m, toks, toks)[0]))
        return grad.lower(model).compile()

    programs = {r: compiled(r) for r in ("none", "full", "minimal")}
    dots = {r: c.compiled.as_text().count(" dot(") for r, c in programs.items()}
    temps = {r: memory(c).temp_bytes for r, c in programs.items()}
    # The layers are one scan, so its body's matmuls appear once in the program (and, unlike an
    # unrolled stack, its saved activations are buffers XLA:CPU's memory analysis counts).
    per_block = 6  # at least q, k, v, out, mlp in, mlp out are recomputed in the body under `full`
    assert dots["full"] >= dots["none"] + per_block, dots
    assert dots["none"] <= dots["minimal"] < dots["full"], dots  # minimal recomputes only attention's batched dots
    assert temps["full"] < temps["none"], temps


KERNELS = ["reference", "blockwise"]
MASKS = [dict(mask="causal"), dict(mask="sliding", window=5)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mask", MASKS, ids=["causal", "sliding"])
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "packed"])
def test_future_tokens_never_change_the_past(kernel, mask, documents):
    cfg = TINY_LLAMA.replace(attention_kernel=kernel, **mask)
    model = nn.GPT(cfg, key=jax.random.key(0))
    toks = tokens(jax.random.key(1), batch=2, seq=24)
    seg = jnp.repeat(jnp.array([[0] * 10 + [1] * 14]), 2, axis=0) if documents else None
    t = 13
    changed = toks.at[:, t + 1 :].set((toks[:, t + 1 :] + 7) % cfg.vocab_size)
    a = model(toks, segment_ids=seg)
    b = model(changed, segment_ids=seg)
    np.testing.assert_allclose(a[:, : t + 1], b[:, : t + 1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_documents_do_not_attend_across_boundaries():
    model = nn.GPT(TINY_LLAMA, key=jax.random.key(0))
    toks = tokens(jax.random.key(1), batch=1, seq=20)
    seg = jnp.array([[0] * 8 + [1] * 12])
    changed = toks.at[:, :8].set((toks[:, :8] + 3) % 64)
    a = model(toks, segment_ids=seg)
    b = model(changed, segment_ids=seg)
    np.testing.assert_allclose(a[:, 8:], b[:, 8:], rtol=1e-5, atol=1e-6)


def test_block_skipping_agrees_with_the_elementwise_mask():
    rng = np.random.default_rng(0)
    for mask in (nn.CausalMask(), nn.SlidingWindowMask(6), nn.FullMask()):
        for _ in range(50):
            q = jnp.asarray(rng.integers(0, 40, 8))
            k = jnp.asarray(rng.integers(0, 40, 8))
            if bool(mask(q, k).any()):
                assert bool(mask.block_may_attend(q, k))


def test_document_mask_insists_on_segment_ids():
    with pytest.raises(ValueError, match="segment ids"):
        nn.DocumentMask()(jnp.arange(4), jnp.arange(4))


def test_rope_depends_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
    dot = lambda i, j: jnp.sum(nn.apply_rope(q, jnp.array([i])) * nn.apply_rope(k, jnp.array([j])))  # noqa: E731
    np.testing.assert_allclose(dot(3, 1), dot(103, 101), rtol=1e-4)
    assert not np.allclose(dot(3, 1), dot(3, 2))


@pytest.mark.parametrize("chunk", [16, 5, 64])
def test_chunked_cross_entropy_equals_dense(chunk):
    model = nn.GPT(TINY, key=jax.random.key(0))
    toks = tokens(jax.random.key(1))
    targets = jnp.roll(toks, -1, 1)
    mask = (jnp.arange(16) < 12).astype(jnp.float32)[None].repeat(4, 0)
    loss, aux = nn.lm_loss(model, toks, targets, loss_mask=mask, chunk_size=chunk, z_loss=1e-3)
    logits = model(toks)
    lse = jax.nn.logsumexp(logits, -1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    want_nll = jnp.sum(nll * mask) / jnp.sum(mask)
    want_z = jnp.sum(lse**2 * mask) / jnp.sum(mask)
    np.testing.assert_allclose(aux["nll"], want_nll, rtol=1e-5)
    np.testing.assert_allclose(loss, want_nll + 1e-3 * want_z, rtol=1e-5)


def test_chunked_loss_never_holds_all_fp32_logits():
    cfg = TINY.replace(vocab_size=4096, seq_len=256)
    params, static = eqx.partition(nn.GPT(cfg, key=jax.random.key(0)), eqx.is_array)
    toks = jnp.zeros((8, 256), jnp.int32)
    hidden = jnp.zeros((8, 256, cfg.embed_dim))
    full_logits_bytes = 8 * 256 * 4096 * 4

    def temp_bytes(chunk):
        def grad_fn(p, h):
            loss = lambda p, h: nn.chunked_cross_entropy(  # noqa: E731
                eqx.combine(p, static).logits, h, toks, chunk_size=chunk)[0]
            return jax.grad(loss, argnums=(0, 1))(p, h)

        return jax.jit(grad_fn).lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(32) < full_logits_bytes / 2 < temp_bytes(256)


def test_norms_match_their_formulas():
    x = jax.random.normal(jax.random.key(0), (3, 8)) * 3 + 1
    ln = nn.LayerNorm(8)(x)
    want = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln, want, rtol=1e-5, atol=1e-5)
    rms = nn.RMSNorm(8)(x)
    np.testing.assert_allclose(rms, x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6), rtol=1e-5)


@pytest.mark.parametrize("cfg", [TINY, TINY_LLAMA, TINY_LLAMA.replace(mask="sliding", window=3),
                                 TINY.replace(attention_kernel="blockwise", scan_layers=False)],
                         ids=["gpt2", "llama", "llama-window3", "gpt2-blockwise-prefill-unrolled"])
def test_kv_cache_decode_equals_full_forward(cfg):
    """Prefill 7 tokens, then decode 5 one by one: the logits of the whole forward. The window
    (3 keys) is shorter than the cache, so decoding must drop keys the cache still holds."""
    model = nn.GPT(cfg, key=jax.random.key(0))
    toks = tokens(jax.random.key(1), batch=2, seq=12)
    full = model(toks)
    cache = model.init_cache(2, 16)
    logits, cache = model.decode(toks[:, :7], cache, 0)
    steps = [logits]
    for i in range(7, 12):
        logits, cache = model.decode(toks[:, i : i + 1], cache, i)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the non-GPU error path")
def test_cudnn_kernel_refuses_to_run_off_gpu():
    model = nn.GPT(TINY.replace(attention_kernel="cudnn"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs a GPU"):
        model(tokens(jax.random.key(1)))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a CUDA GPU")
def test_cudnn_matches_reference_on_gpu():
    from eqgpt.nn.kernels import cudnn_attention, reference_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 128, 4, 64), jnp.bfloat16) for i in range(3))
    pos = jnp.arange(128)
    kw = dict(mask=nn.CausalMask(), q_pos=pos, k_pos=pos)
    np.testing.assert_allclose(
        cudnn_attention(q, k, v, **kw).astype(jnp.float32),
        reference_attention(q, k, v, **kw).astype(jnp.float32), atol=2e-2,
    )
