"""Whole models, SwiGLU, the GELU MLP, RMSNorm and the loss against the NumPy definitions of
`tests/references.py`, with no `transformers` or torch: the checks the Python 3.12 leg runs
where `tests/test_interop.py` skips.

Every parameter is drawn at random (norm scales and biases too, so a dropped scale or bias
shows), and the loss is also checked at logits of scale 1e4, where a log-sum-exp without its
maximum subtracted overflows fp32. fp32 against float64: the measured errors are at most 7e-7
relative to the largest entry (logits), so the tolerance is 1e-5.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import references as ref
from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.nn.loss import chunked_cross_entropy, head_loss_sums
from eqgpt.nn.norm import make_norm
from eqgpt.parallel.strategy import lm_batch_loss
from helpers import TINY, TINY_LLAMA, assert_within, rel_err

TOL = 1e-5


def randomised(model, seed=0, scale=0.3):
    """`model` with every array replaced by normal noise of `scale` (norm scales around 1)."""
    arrays, rest = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    model = eqx.combine(jax.tree.unflatten(tree, leaves), rest)
    if not isinstance(model, nn.GPT):
        return model
    norms = lambda m: [m.norm.weight, m.blocks.attn_norm.weight, m.blocks.mlp_norm.weight]  # noqa: E731
    return eqx.tree_at(norms, model, [1.0 + w for w in norms(model)])


def numpy_params(model) -> dict:
    """The model's arrays in the layout `references.transformer_logits` reads."""
    a = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    bl = model.blocks

    def lin(m, i):
        return {"w": a(m.weight)[i], "b": None if m.bias is None else a(m.bias)[i]}

    def norm(m, i=None):
        w, b = a(m.weight), a(getattr(m, "bias", None))
        return {"w": w if i is None else w[i], "b": b if b is None or i is None else b[i]}

    layers = []
    for i in range(model.config.num_layers):
        mlp = bl.mlp
        m = ({"gate": a(mlp.gate.weight)[i], "up": a(mlp.up.weight)[i], "down": a(mlp.down.weight)[i]}
             if hasattr(mlp, "gate") else
             {"up": a(mlp.up.weight)[i], "up_b": a(mlp.up.bias)[i], "down": a(mlp.down.weight)[i],
              "down_b": a(mlp.down.bias)[i]})
        layers.append({"attn_norm": norm(bl.attn_norm, i), "mlp_norm": norm(bl.mlp_norm, i), "mlp": m,
                       **{n: lin(getattr(bl.attn, f"{n}_proj"), i) for n in "qkvo"}})
    return {"embed": a(model.tok_embed.weight), "pos": None if model.pos_embed is None else a(model.pos_embed.weight),
            "head": None if model.head is None else a(model.head.weight), "final_norm": norm(model.norm),
            "layers": layers}


def reference_logits(model, tokens, **kw):
    c = model.config
    return ref.transformer_logits(numpy_params(model), tokens, heads=c.num_heads, kind="llama" if c.norm == "rmsnorm"
                                  else "gpt2", eps=c.norm_eps, theta=c.rope_theta, window=c.window, **kw)


def packed_inputs(b, t):
    seg = np.tile(np.repeat([1, 2, 3], [t // 2, t // 4, t - t // 2 - t // 4]), (b, 1)).astype(np.int32)
    pos = np.zeros_like(seg)
    for r in range(b):
        for s in (1, 2, 3):
            pos[r, seg[r] == s] = np.arange((seg[r] == s).sum())
    return seg, pos


CONFIGS = {"gpt2": TINY, "llama": TINY_LLAMA, "llama-sliding": TINY_LLAMA.replace(mask="sliding", window=5)}


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_logits_match_the_numpy_transformer(name, packed):
    model = randomised(nn.GPT(CONFIGS[name], key=jax.random.key(0)))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, model.config.vocab_size))
    kw = dict(zip(("segment_ids", "doc_positions"), packed_inputs(*tokens.shape), strict=True)) if packed else {}
    got = jax.jit(lambda m, x, kw: m(x, **kw))(model, jnp.asarray(tokens), {k: jnp.asarray(v) for k, v in kw.items()})
    assert_within(rel_err(got, reference_logits(model, tokens, **kw)), TOL, f"{name} logits")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_lm_loss_of_a_batch_is_the_numpy_cross_entropy(name):
    """The training loss of a `Batch` with a loss mask and packed documents: the masked mean NLL of
    the reference logits."""
    model = randomised(nn.GPT(CONFIGS[name], key=jax.random.key(2)))
    windows = np.asarray(jax.random.randint(jax.random.key(3), (2, 17), 0, model.config.vocab_size))
    seg, pos = packed_inputs(2, 16)
    mask = (np.arange(16) % 3 != 0).astype(np.float32)[None].repeat(2, 0)
    b = Batch.from_windows(windows)
    batch = Batch(b.tokens, b.targets, loss_mask=mask, segment_ids=seg, positions=pos)
    loss, _ = jax.jit(lambda m, x: lm_batch_loss(m, x, chunk_size=4))(model, batch)
    logits = reference_logits(model, b.tokens, segment_ids=seg, doc_positions=pos)
    want = ref.cross_entropy(logits, np.asarray(b.targets), mask)[0]
    assert_within(abs(float(loss) - want) / want, TOL, f"{name} loss")


def test_swiglu_and_gelu_mlp_are_their_definitions():
    x = jax.random.normal(jax.random.key(4), (2, 5, 8))
    sw = randomised(nn.SwiGLU(8, 24, key=jax.random.key(5)), scale=0.5)
    want = ref.swiglu(x, sw.gate.weight, sw.up.weight, sw.down.weight)
    assert_within(rel_err(sw(x), want), TOL, "SwiGLU")
    mlp = randomised(nn.MLP(8, 24, key=jax.random.key(6)), scale=0.5)
    want = ref.gelu_mlp(x, mlp.up.weight, np.asarray(mlp.up.bias), mlp.down.weight, np.asarray(mlp.down.bias))
    assert_within(rel_err(mlp(x), want), TOL, "GELU MLP")


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4], ids=["tiny", "unit", "huge"])
def test_norms_with_learned_scales_at_any_magnitude(scale):
    """RMSNorm and LayerNorm are scale-invariant down to where `eps` takes over, and keep their
    learned scale and bias: at inputs of 1e-4 (eps of 1e-6 is not negligible) up to 1e4."""
    x = scale * (jax.random.normal(jax.random.key(7), (3, 16)) + 0.5)
    w, bias = 1 + 0.5 * jax.random.normal(jax.random.key(8), (16,)), jax.random.normal(jax.random.key(9), (16,))
    rms = eqx.tree_at(lambda m: m.weight, nn.RMSNorm(16, eps=1e-6), w)
    assert_within(rel_err(rms(x), ref.rms_norm(x, w, 1e-6)), TOL, "RMSNorm")
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), nn.LayerNorm(16, eps=1e-5), (w, bias))
    assert_within(rel_err(ln(x), ref.layer_norm(x, w, bias, 1e-5)), TOL, "LayerNorm")


@pytest.mark.parametrize("loss", ["chunked", "fused"])
def test_loss_at_huge_logits(loss):
    """Logits of scale 1e4 (exp overflows fp32 beyond 88): the loss, its z-loss and its gradient
    in the logits still match the float64 definition."""
    hidden = jax.random.normal(jax.random.key(10), (2, 6, 8))
    weight = 2e3 * jax.random.normal(jax.random.key(11), (11, 8))
    targets = jax.random.randint(jax.random.key(12), (2, 6), 0, 11)
    mask = jnp.asarray([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 1]], jnp.float32)

    def value(h):
        if loss == "chunked":
            return chunked_cross_entropy(lambda x: x @ weight.T, h, targets, loss_mask=mask, chunk_size=4,
                                         z_loss=1e-4)[0]
        total, (_, _, count) = head_loss_sums(h, weight, targets, loss_mask=mask, chunk_size=4, z_loss=1e-4)
        return total / count

    got, d_hidden = jax.jit(jax.value_and_grad(value))(hidden)
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64).T
    want = ref.cross_entropy(logits, targets, mask, 1e-4)[0]
    assert np.isfinite(float(got)) and abs(float(got) - want) / want < TOL
    want_dh = ref.cross_entropy_logit_grad(logits, targets, mask, 1e-4) @ np.asarray(weight, np.float64)
    assert_within(rel_err(d_hidden, want_dh), 1e-4, "gradient")


def central_difference(f, x, direction, h=1e-5):
    """`d/dt f(x + t direction)` at 0, float64 (error of order h^2 * f''')."""
    return (f(x + h * direction) - f(x - h * direction)) / (2 * h)


def test_gelu_derivative_is_the_slope_of_its_definition():
    """`gelu_tanh`'s hand-written derivative against the float64 slope of the tanh-GELU formula,
    from -12 to 12 (where tanh saturates)."""
    from eqgpt.nn.mlp import gelu_tanh

    x = np.linspace(-12.0, 12.0, 241)
    got = jax.vmap(jax.grad(gelu_tanh))(jnp.asarray(x, jnp.float32))
    want = central_difference(ref.gelu_tanh, x, np.ones_like(x))
    assert_within(float(np.max(np.abs(np.asarray(got, np.float64) - want))), 1e-5, "slope")


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_mlp_gradients_are_the_slopes_of_their_definitions(kind):
    """Every input's and weight's gradient of `sum(mlp(x) * r)`, against the float64 directional
    slope of the NumPy definition along a random direction."""
    if kind == "swiglu":
        layer = randomised(nn.SwiGLU(8, 24, key=jax.random.key(13)), scale=0.5)
        names = ("gate", "up", "down")
        define = lambda x, w: ref.swiglu(x, *w)  # noqa: E731
    else:
        layer = randomised(nn.MLP(8, 24, key=jax.random.key(14)), scale=0.5)
        names = ("up", "up_b", "down", "down_b")
        define = lambda x, w: ref.gelu_mlp(x, *w)  # noqa: E731
    get = {"gate": lambda m: m.gate.weight, "up": lambda m: m.up.weight, "down": lambda m: m.down.weight,
           "up_b": lambda m: m.up.bias, "down_b": lambda m: m.down.bias}
    x = 2.0 * jax.random.normal(jax.random.key(15), (2, 5, 8))
    r = np.asarray(jax.random.normal(jax.random.key(16), (2, 5, 8)), np.float64)
    d_x, d_layer = jax.grad(lambda x, m: jnp.sum(m(x) * r), argnums=(0, 1))(x, layer)
    x64 = np.asarray(x, np.float64)
    w64 = [np.asarray(get[n](layer), np.float64) for n in names]
    rng = np.random.default_rng(0)
    for i, grad in [(None, d_x), *((i, get[n](d_layer)) for i, n in enumerate(names))]:
        like = x64 if i is None else w64[i]
        direction = rng.standard_normal(like.shape)

        def along(t_dir, i=i):
            if i is None:
                return float(np.sum(define(t_dir, w64) * r))
            return float(np.sum(define(x64, [t_dir if j == i else w for j, w in enumerate(w64)]) * r))

        want = central_difference(along, like, direction)
        got = float(np.sum(np.asarray(grad, np.float64) * direction))
        assert_within(abs(got - want) / abs(want), 1e-4, f"{kind} {'x' if i is None else names[i]} slope")


def test_norm_defaults_and_axes():
    """The defaults a user gets: LayerNorm eps 1e-5 with a bias, RMSNorm eps 1e-6 (inputs of scale
    1e-3, where eps is 1 to 10% of the mean square), and the logical axes sharding rules read."""
    x = 1e-3 * jax.random.normal(jax.random.key(17), (3, 16))
    ones = np.ones(16)
    assert_within(rel_err(nn.RMSNorm(16)(x), ref.rms_norm(x, ones, 1e-6)), TOL, "RMSNorm default")
    assert_within(rel_err(nn.LayerNorm(16)(x), ref.layer_norm(x, ones, np.zeros(16), 1e-5)), TOL, "LayerNorm default")
    assert nn.LayerNorm(16).bias is not None and nn.LayerNorm(16, use_bias=False).bias is None
    assert nn.LayerNorm(16).param_axes() == {"weight": ("embed",), "bias": ("embed",)}
    assert nn.RMSNorm(16).param_axes() == {"weight": ("embed",)}
    assert nn.RMSNorm(16).dim == 16 and nn.LayerNorm(16).dim == 16  # public fields
    for norm in (nn.RMSNorm(16), nn.LayerNorm(16)):  # computed in fp32, returned in the input's dtype
        assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    rms, ln = make_norm("rmsnorm", 16, eps=1e-3), make_norm("layernorm", 16, eps=1e-3)
    assert isinstance(rms, nn.RMSNorm) and isinstance(ln, nn.LayerNorm) and rms.eps == ln.eps == 1e-3
    assert ln.bias is not None and make_norm("layernorm", 16, eps=1e-3, use_bias=False).bias is None
    with pytest.raises(ValueError, match='choose "layernorm" or "rmsnorm"'):
        make_norm("batchnorm", 16, eps=1e-5)
