"""Pipeline schedules equal the single-device model; the compiled step is the evidence.

- parity over 5 optimizer steps of the library's step (losses, parameters; fp32)
  for 1F1B past its warm-up (m=8 at p=4), interleaved with uneven chunks, 1F1B with FSDP
  (GPipe's, 1F1B's and interleaving's first step are compared leaf by leaf in
  test_gradient_parity), and composed with context
  parallelism and TP (`pipeline=2,context=2,tensor=2`; more compositions run
  through the recipe in test_strategies);
- a user's own model (its block and squared-ReLU MLP defined here, from
  `eqgpt.nn.Linear`) runs as a pipeline through the `LanguageModel` protocol;
- data-parallel reductions run once per step, stage-to-stage permutes twice per tick;
- temporary memory: flat under 1F1B as m grows, growing under GPipe;
- ZB-H1 (split backward): 1F1B's gradients and one device's, and 1F1B's memory
  within 10% (its recipe runs are in test_strategies).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqgpt
from eqgpt import nn
from eqgpt.data import Batch
from eqgpt.parallel import Pipeline, Strategy, make_mesh, path_str
from eqgpt.parallel.context import Context, ContextKernel
from eqgpt.parallel.pipeline import lower, make_pipeline_schedule, pipeline_grad_fn
from eqgpt.parallel.pipeline.part import pipeline_schedule
from eqgpt.profile import collectives
from eqgpt.train import TrainState, make_train_step
from markov import falls, markov_windows
from parallel_cases import OPTIONS

CFG = eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=8, num_heads=4, embed_dim=32)
BATCH, SEQ, STEPS = 16, 16, 5
# SGD with momentum: the update is linear in the gradients, so fp32 rounding differences
# stay rounding-sized over the steps (Adam's first steps are ~sign(g): they would amplify them).
OPTIMIZER = optax.sgd(0.2, momentum=0.9)


def make_batch(step, vocab=CFG.vocab_size) -> Batch:
    """Rows of a fixed Markov chain (`markov`), a model can learn from, with a random loss mask."""
    windows = Batch.from_windows(jnp.asarray(markov_windows(200 + step, BATCH, SEQ, vocab)))
    km = jax.random.fold_in(jax.random.key(7), step)
    # Uneven token counts per microbatch: the loss must weight microbatches by tokens.
    return Batch(windows.tokens, windows.targets,
                 loss_mask=(jax.random.uniform(km, (BATCH, SEQ)) < 0.7).astype(jnp.float32))


@pytest.fixture(scope="module")
def init_model():
    return eqx.filter_jit(lambda k: nn.GPT(CFG, key=k))(jax.random.key(0))


def train(strategy, model, steps=STEPS, vocab=CFG.vocab_size):
    """`steps` steps of the library's step: per-step losses and nll, the final model, the compiled step."""
    model = strategy.place_model(model)
    state = TrainState(model, strategy.init_opt_state(OPTIMIZER, model), rng=jax.random.key(0))
    batches = [strategy.batch(make_batch(i, vocab)) for i in range(steps)]
    compiled = make_train_step(OPTIMIZER, strategy=strategy, donate=False).lower(state, batches[0]).compile(OPTIONS)
    losses = []
    for b in batches:
        state, metrics = compiled(state, b)
        assert metrics["loss"].sharding.is_fully_replicated  # held by every device, not only the last stage
        losses.append((float(metrics["loss"]), float(metrics["nll"])))
    return losses, state.model, compiled


@pytest.fixture(scope="module")
def reference(init_model):
    """Single-device fp32: per-step (loss, nll) and the final parameters."""
    return train(Strategy(), init_model)[:2]


def close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# Pipelines composed with TP and FSDP run through the recipe in test_strategies too.
CASES = {
    "1f1b-m8": ("pipeline=4,data=2", "dp", "1f1b", 8),
    "pp4-fsdp2": ("pipeline=4,fsdp=2", "fsdp", "1f1b", 4),
    # Uneven chunks (the last runs no layer, only the head), padding slots skipped; uneven 1F1B
    # stages run through the recipe (test_strategies, and docs/parallelism/pipeline.md's command).
    "interleaved-uneven": ("pipeline=4,data=2", "dp", "interleaved", 4, (2, 1, 1, 1, 1, 1, 1, 0)),
}


def check_reductions_once_per_step(compiled, mesh, schedule):
    """Every collective over data/fsdp runs once per call (not per microbatch); two permutes per tick.

    (With interleaving, XLA also moves the layer stack between the stored and the
    interleaved order once per step; those permutes run once.)
    """
    rows = collectives(compiled, mesh)
    batch_rows = [r for r in rows if r.axes and set(r.axes) & {"data", "fsdp"}]
    assert batch_rows, "expected the gradient reduction over the data-parallel axes"
    assert all(r.executions == 1 for r in batch_rows), [(r.kind, r.axes, r.executions) for r in batch_rows]
    permutes = [r for r in rows if r.kind == "collective-permute" and r.axes == ("pipeline",)]
    in_loop = [r.executions for r in permutes if r.executions > 1]
    assert in_loop == [schedule.num_ticks] * 2, [(r.shapes, r.executions) for r in permutes]


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_device_over_five_steps(case, init_model, reference):
    mesh_spec, rules, schedule, m, *split = CASES[case]
    strategy = Strategy(make_mesh(mesh_spec), rules,
                        parts=(Pipeline(schedule, m, virtual_stages=2, layers_per_stage=(split or ["equal"])[0]),))
    ref_losses, ref_final = reference
    assert falls([loss for loss, _ in ref_losses])
    losses, final, compiled = train(strategy, init_model)
    check_reductions_once_per_step(compiled, strategy.mesh, pipeline_schedule(strategy.mesh, strategy.part(Pipeline)))
    # Losses (and nll) step by step; after 5 momentum-SGD steps every parameter, so every gradient.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(eqx.filter(final, eqx.is_array), eqx.filter(ref_final, eqx.is_array), rtol=1e-4, atol=1e-5)


def test_pipeline_with_context_parallelism_trains_like_one_device(init_model, reference):
    """`pipeline=2,context=2,tensor=2`: the sequence (zigzag) over context inside every stage.

    GPT-2 style (learned positions: the layout's global positions reach the
    embedding), a loss mask with uneven counts, heads over `tensor`. Inside a stage
    attention gathers keys and values over `context` (its context peers take the
    same branch of the tick); no ring permutes run there.
    """
    strategy = Strategy(make_mesh("pipeline=2,context=2,tensor=2"), "tp",
                        parts=(Pipeline("1f1b", 4), Context("ring", block=4)))
    ref_losses, ref_final = reference
    losses, final, compiled = train(strategy, init_model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(eqx.filter(final, eqx.is_array), eqx.filter(ref_final, eqx.is_array), rtol=1e-4, atol=1e-5)
    # The same parameter tree as the plain model's; only the kernel (static) differs.
    paths = lambda m: [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(eqx.filter(m, eqx.is_array))[0]]  # noqa: E731
    assert paths(final) == paths(ref_final)
    assert isinstance(final.blocks.attn.kernel, ContextKernel)
    rows = collectives(compiled, strategy.mesh)
    on_context = [r for r in rows if r.axes and "context" in r.axes]
    assert any(r.kind == "all-gather" and r.executions > 1 for r in on_context), on_context
    assert not [r for r in on_context if r.kind == "collective-permute"], on_context


class SquaredReLU(eqx.Module):
    """A user's MLP: `down(relu(up(x))^2)`, from `eqgpt.nn.Linear` with logical axes."""

    up: nn.Linear
    down: nn.Linear

    def __init__(self, dim, hidden, *, key):
        ku, kd = jax.random.split(key)
        self.up = nn.Linear(dim, hidden, axes=("embed", "mlp"), key=ku)
        self.down = nn.Linear(hidden, dim, axes=("mlp", "embed"), key=kd)

    def __call__(self, x):
        return self.down(jnp.square(jax.nn.relu(self.up(x))))


class UserBlock(eqx.Module):
    """A user's layer: one norm, attention and the MLP side by side (parallel residual)."""

    norm: nn.RMSNorm
    attn: nn.Attention
    mlp: SquaredReLU

    def __call__(self, x, positions, segment_ids):
        h = self.norm(x)
        return x + self.attn(h, positions=positions, segment_ids=segment_ids) + self.mlp(h)


class UserLM(nn.LanguageModel):
    """A language model of the user's own that is not a `GPT`: only the contract's abstract members."""

    table: nn.Embedding
    blocks: UserBlock
    final_norm: nn.RMSNorm
    head: nn.Linear

    def __init__(self, vocab, dim, layers, *, key):
        kt, kb, kh = jax.random.split(key, 3)

        def block(k):
            ka, km = jax.random.split(k)
            return UserBlock(nn.RMSNorm(dim), nn.Attention(dim, 4, 2, rope_theta=10_000.0, key=ka),
                             SquaredReLU(dim, 2 * dim, key=km))

        self.table = nn.Embedding(vocab, dim, axes=("vocab", "embed"), key=kt)
        self.blocks = eqx.filter_vmap(block)(jax.random.split(kb, layers))
        self.final_norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, axes=("embed", "vocab"), use_bias=False, key=kh)

    def embed(self, tokens, positions):
        return self.table(tokens)  # RoPE inside attention carries the positions

    def run_blocks(self, x, positions, segment_ids=None):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        layer = lambda h, p: (eqx.combine(p, static)(h, positions, segment_ids), None)  # noqa: E731
        return jax.lax.scan(layer, x, dynamic)[0]

    def norm(self, h):
        return self.final_norm(h)

    def logits(self, h):
        return self.head(h)

    def logical_sizes(self):
        vocab, dim = self.table.weight.shape
        return {"vocab": vocab, "embed": dim, "heads": dim, "kv_heads": dim // 2, "mlp": 2 * dim,
                "layers": nn.protocol.num_layers(self), "head_dim": dim // 4, "seq_len": 1 << 20}


def test_a_users_own_model_runs_as_a_pipeline():
    """The executor reads a model only through `eqgpt.nn.LanguageModel`: a user's model
    (its own block, MLP and head) trains on `pipeline=4,data=2` like on one device."""
    model = UserLM(48, 32, 4, key=jax.random.key(3))
    assert isinstance(model, nn.LanguageModel) and not isinstance(model, nn.GPT)
    ref_losses, ref_final = train(Strategy(), model, vocab=48)[:2]
    strategy = Strategy(make_mesh("pipeline=4,data=2"), "dp", parts=(Pipeline("1f1b", 4),))
    losses, final, _ = train(strategy, model, vocab=48)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    close(eqx.filter(final, eqx.is_array), eqx.filter(ref_final, eqx.is_array), rtol=1e-4, atol=1e-5)


@functools.cache
def _temp(schedule_name, m, microbatch=4, seq=64):
    """Per-device temporary memory of the compiled step, on `pipeline=4,data=2`, a fixed microbatch size."""
    cfg = CFG.replace(seq_len=seq, num_layers=4)
    model = eqx.filter_eval_shape(lambda k: nn.GPT(cfg, key=k), jax.random.key(0))
    mesh = make_mesh("pipeline=4,data=2")
    shape = (m * microbatch * mesh.shape["data"], seq)
    z = np.zeros(shape, np.int32)  # only the shapes matter: the step is compiled, not run
    fn = pipeline_grad_fn(mesh, schedule_name, m)
    return fn.temp_bytes(model, Batch(z, z))


STAGE_INPUT = 4 * 64 * 32 * 4  # one microbatch's activations [4, 64, 32] fp32, the size of every buffer slot


def test_temp_memory_flat_under_1f1b_growing_under_gpipe():
    """Fixed microbatch size, m from 4 to 16 (from `compiled.memory_analysis()`)."""
    f4, f16 = _temp("1f1b", 4), _temp("1f1b", 16)
    g4, g16 = _temp("gpipe", 4), _temp("gpipe", 16)
    assert abs(f16 / f4 - 1) < 0.15, (f4, f16)
    # GPipe holds m stage inputs [4, 64, 32] fp32: 12 more at m=16 than at m=4.
    extra_inputs = (lower(make_pipeline_schedule("gpipe", 4, 16)).act_slots - 4) * STAGE_INPUT
    assert g16 - g4 >= 0.9 * extra_inputs, (g4, g16, extra_inputs)


def test_zero_bubble_temp_memory_within_ten_percent_of_1f1b():
    """ZB-H1 holds 1F1B's `p` stage inputs, plus the incoming gradients its deferred W's still
    need: the compiled step shows those extra slots, and stays within 10% of 1F1B's memory."""
    f, z = _temp("1f1b", 4), _temp("zb1", 4)
    zb, f1b = lower(make_pipeline_schedule("zb1", 4, 4)), lower(make_pipeline_schedule("1f1b", 4, 4))
    assert zb.act_slots == f1b.act_slots == 4
    extra = (zb.grad_slots - f1b.grad_slots) * STAGE_INPUT
    assert extra > 0 and f + extra <= z <= 1.10 * f, (f, z, extra)


@pytest.fixture(scope="module")
def one_device_grads(init_model):
    """One device's loss and gradients on the first masked batch, for both zero-bubble meshes."""
    return eqx.filter_jit(Strategy().grad_fn())(init_model, make_batch(0))


@pytest.mark.parametrize("mesh_spec, rules", [("pipeline=4,data=2", "dp"), ("pipeline=2,fsdp=2,tensor=2", "fsdp+tp")])
def test_zero_bubble_gradients_equal_1f1b_and_one_device(mesh_spec, rules, init_model, one_device_grads):
    """The split backward (B: vjp in the stage input; W: vjp in the parameters, ticks later)
    gives 1F1B's gradients, and one device's (one masked batch)."""
    batch = make_batch(0)
    (loss, _), ref = one_device_grads
    out = {}
    for schedule in ("1f1b", "zb1"):
        strategy = Strategy(make_mesh(mesh_spec), rules, parts=(Pipeline(schedule, 4),))
        out[schedule] = strategy.grad_fn()(strategy.place_model(init_model), strategy.batch(batch))
    (loss_1f1b, _), g_1f1b = out["1f1b"]
    (loss_zb, _), g_zb = out["zb1"]
    np.testing.assert_allclose([loss_zb, loss_1f1b], [loss, loss], rtol=1e-5)
    close(g_zb, g_1f1b, rtol=1e-5, atol=1e-7)
    close(g_zb, ref, rtol=1e-5, atol=1e-6)
