"""Small shared pieces for the tests: tiny configs, tree comparison and the checks of a run against one device."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np

import eqgpt

TINY = eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=2, num_heads=4, embed_dim=32)
TINY_LLAMA = eqgpt.preset("llama-nano").replace(
    vocab_size=64, seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, mlp_dim=64
)


# Absolute tolerance on parameters after several AdamW steps of a parallel run against one
# device. Summation order differs between layouts, and where a gradient entry is near zero
# Adam's normalisation amplifies that rounding into the update: about 1e-6 on weights of
# order 1e-2 after 5 steps (rtol 1e-5 holds everywhere else).
PARAM_ATOL = 2e-6

# GPT-2 style attention has a key bias. Its exact gradient is zero: it adds q.b_k
# to every score of a query, and softmax ignores a per-query constant. So its
# gradient is float rounding noise, which Adam divides by sqrt(v) + eps and turns
# into updates of up to ~lr/10: its values are noise of size ~1e-5 whose last bits
# depend on the summation order. It is compared with atol 2e-5 (values stay < 1e-4);
# every other array with rtol 1e-5, atol PARAM_ATOL.
NOISE_ONLY = {"blocks.attn.k_proj.bias": 2e-5}


def tokens(key, batch=4, seq=16, vocab=64):
    return jax.random.randint(key, (batch, seq), 0, vocab)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_within(err: float, tol: float, what: str = "error") -> None:
    """Fail when `err` exceeds `tol`, saying by what margin (`err / tol`: the mutation catalogue reads it)."""
    assert err <= tol, f"{what} {err:.3g} above tolerance {tol:g} [margin {err / tol:.3g}x]"


def rel_err(got, want) -> float:
    """Largest absolute difference over the largest `|want|`, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def assert_arrays_close(got, want, what="", rtol=1e-5, atol=PARAM_ATOL):
    """The same array names; each array within `rtol`, `atol` (NOISE_ONLY for the key bias)."""
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=rtol, atol=NOISE_ONLY.get(path, atol),
                                   err_msg=f"{what}: {path}" if what else path)


def assert_same_training(ref, out, rtol=1e-5, steps=5, atol=PARAM_ATOL):
    """`(losses, arrays)` of a run against the reference's: per-step losses within `rtol`, every
    final parameter as `assert_arrays_close`; with `steps`, that many steps and a falling loss."""
    from markov import falls

    np.testing.assert_allclose(out[0], ref[0], rtol=rtol, atol=0)
    if steps is not None:
        assert len(out[0]) == steps and falls(ref[0])
    assert_arrays_close(out[1], ref[1], rtol=rtol, atol=atol)


def max_abs(tree):
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def compiled_step(config, strategy, *, rows: int = 8):
    """The compiled training step (AdamW, donation off) of a `GPT(config)` under `strategy`, on
    `rows` random windows: what the compiled-program tests read their collectives from.
    **Returns** (the compiled step, the placed model)."""
    import optax

    from eqgpt.data import Batch
    from eqgpt.nn import GPT
    from eqgpt.train import TrainState, make_train_step

    model = strategy.place_model(GPT(config, key=jax.random.key(0)))
    optimizer = optax.adamw(1e-3)
    state = TrainState(model, strategy.place_opt_state(optimizer.init(eqx.filter(model, eqx.is_array)), model),
                       rng=jax.random.key(0))
    windows = np.asarray(jax.random.randint(jax.random.key(1), (rows, config.seq_len + 1), 0, config.vocab_size))
    step = make_train_step(optimizer, strategy=strategy, model_like=model, donate=False)
    return step.lower(state, strategy.batch(Batch.from_windows(windows))).compile(), model


class UnfusedHead(eqgpt.nn.LanguageModel):
    """A `GPT` without `head_matrix`: `eqgpt.nn.lm_loss` takes the chunked head through `GPT.logits`."""

    gpt: eqgpt.nn.GPT

    @property
    def blocks(self):
        return self.gpt.blocks

    def embed(self, tokens, positions):
        return self.gpt.embed(tokens, positions)

    def run_blocks(self, x, positions, segment_ids=None):
        return self.gpt.run_blocks(x, positions, segment_ids)

    def norm(self, h):
        return self.gpt.norm(h)

    def logits(self, h):
        return self.gpt.logits(h)

    def logical_sizes(self):
        return self.gpt.logical_sizes()

    def features_and_stats(self, tokens, **kw):
        return self.gpt.features_and_stats(tokens, **kw)


@contextlib.contextmanager
def unchecked():
    """Runtime type checks off (`jaxtyping_disable`): for a test of the explicit `ValueError` a
    wrongly typed argument gets where nothing checks types (outside this suite)."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
