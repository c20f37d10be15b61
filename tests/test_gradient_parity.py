"""The first step's gradients of every strategy, leaf by leaf, against one device.

Each case runs one step of the library's `make_train_step` from the single-device
model's weights, on one batch with an uneven loss mask (so the loss must be
normalised by the tokens of all devices), and reads the gradients where the
optimizer receives them: `capture()` keeps the gradients it is given as its state,
before and after global-norm clipping. A ZeRO optimizer state is split over `data`
like any moment, so its global array is the whole gradient however the strategy
reduced it. The update is `-clipped gradient`, so the new parameters check the
pull of the updated blocks (ZeRO's all-gather, the pipeline's stage placement).

Errors are measured per leaf relative to the leaf's largest entry (`leaf_error`).
"""

import functools
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from filelock import FileLock

import eqgpt
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.parallel import ParallelFlags
from eqgpt.parallel.context import Context
from eqgpt.train import Strategy, TrainState, make_train_step
from eqgpt.train.optim import clip_by_global_norm
from markov import markov_windows
from parallel_cases import OPTIONS
from recipe_runs import shared_dir

CONFIGS = {
    "gpt": eqgpt.GPTConfig(vocab_size=64, seq_len=32, num_layers=4, num_heads=8, embed_dim=32),
    "llama": eqgpt.preset("llama-nano").replace(
        vocab_size=64, seq_len=32, num_layers=4, num_heads=8, num_kv_heads=4, embed_dim=32, mlp_dim=64),
    "moe": eqgpt.preset("moe-nano", vocab_size=64, num_layers=2, embed_dim=32, num_heads=2, seq_len=32),
}
ROWS, SEQ = 8, 32
CLIP = 0.1  # below every case's gradient norm: clipping always acts


def capture() -> optax.GradientTransformation:
    """An optimizer stage that keeps the gradients it is given as its state and passes them on."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda updates, state, params=None: (updates, updates))


OPTIMIZER = optax.chain(capture(), clip_by_global_norm(CLIP), capture(), optax.scale(-1.0))


def batch() -> Batch:
    """Eight rows of a Markov chain with an uneven loss mask (devices hold different token counts)."""
    windows = markov_windows(3, ROWS, SEQ, 64)
    mask = np.asarray(jax.random.uniform(jax.random.key(4), (ROWS, SEQ)) < np.linspace(0.3, 1.0, ROWS)[:, None])
    b = Batch.from_windows(windows)
    return Batch(b.tokens, b.targets, loss_mask=mask.astype(np.float32))


@functools.cache
def initial(name: str):
    return eqx.filter_jit(lambda k: nn.GPT(CONFIGS[name], key=k))(jax.random.key(0))


def flat(tree) -> dict[str, np.ndarray]:
    return {par.path_str(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]}


@functools.cache
def first_step(name: str, strategy: Strategy, data=batch) -> dict:
    """One step under `strategy` on `data()`: loss, grad_norm, the raw and clipped gradients, the new parameters."""
    model = strategy.place_model(initial(name))
    state = TrainState(model, strategy.init_opt_state(OPTIMIZER, model), rng=jax.random.key(0))
    step = make_train_step(OPTIMIZER, strategy=strategy, model_like=model, donate=False)
    b = strategy.batch(data())
    state, metrics = step.lower(state, b).compile(OPTIONS)(state, b)
    raw, _, clipped, _ = state.opt_state
    return {**{k: float(metrics[k]) for k in ("loss", "grad_norm", "moe_balance") if k in metrics},
            "raw": flat(raw), "clipped": flat(clipped), "params": flat(state.model)}


# Steps compile with parallel_cases.OPTIONS (LLVM effort only: same HLO, about half the compile
# time). Measured floor (fp32, 28 strategies on 8 CPU devices against one): 8.7e-7 (sp; the largest
# `leaf_error` of any leaf, raw or clipped gradient or new parameter; the loss and grad_norm
# agree to 1e-7). The MoE cases' worst is 7.2e-7, their balance metric agrees
# to 1.2e-7. The tolerance is 6x the floor; a bug fails by its margin, error / TOL.
TOL = 5e-6


def leaf_error(got: np.ndarray, want: np.ndarray, scale: float) -> float:
    """Largest difference relative to the leaf's largest entry, or to 1e-3 of the tree's largest
    where the leaf is smaller (GPT-2's key bias: its exact gradient is zero, its values rounding)."""
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-3 * scale))


def errors(got: dict, want: dict) -> dict[str, float]:
    """Every compared quantity's error: per leaf of the raw and clipped gradients and the new
    parameters, and the relative error of the loss, grad_norm and (MoE) balance metric."""
    out = {}
    for kind in ("raw", "clipped", "params"):
        assert got[kind].keys() == want[kind].keys()
        scale = max(np.max(np.abs(x)) for x in want[kind].values())
        out.update({f"{kind} {path}": leaf_error(got[kind][path], want[kind][path], scale) for path in want[kind]})
    assert got.keys() == want.keys()  # an MoE run reports its balance metric on every path
    out.update({k: abs(got[k] - want[k]) / want[k] for k in ("loss", "grad_norm", "moe_balance") if k in want})
    return out


CASES = {
    "dp": ("gpt", lambda: ParallelFlags.parse("data=8", "dp")),
    "fsdp": ("gpt", lambda: ParallelFlags.parse("fsdp=8", "fsdp")),
    "tp": ("gpt", lambda: ParallelFlags.parse("tensor=8", "tp")),
    "sp": ("llama", lambda: ParallelFlags.parse("data=2,tensor=4", "dp+sp")),
    "dp+fsdp+tp": ("llama", lambda: ParallelFlags.parse("data=2,fsdp=2,tensor=2", "dp+fsdp+tp")),
    "manual-dp": ("gpt", lambda: ParallelFlags.parse("data=8", "dp", manual=True)),
    "manual-tp": ("llama", lambda: ParallelFlags.parse("data=2,tensor=4", "dp+tp", manual=True)),
    "manual-sp": ("gpt", lambda: ParallelFlags.parse("data=2,tensor=4", "dp+sp", manual=True)),
    "zero1-auto": ("gpt", lambda: ParallelFlags.parse("data=8", "dp", zero=1)),
    "zero2-auto": ("gpt", lambda: ParallelFlags.parse("data=8", "dp", zero=2)),
    "zero1-manual": ("gpt", lambda: ParallelFlags.parse("data=8", "dp", zero=1, manual=True)),
    "zero2-manual": ("gpt", lambda: ParallelFlags.parse("data=8", "dp", zero=2, manual=True)),
    "context-ring": ("llama", lambda: Strategy(par.make_mesh("context=4,data=2"), "dp",
                                               parts=(Context("ring", block=4),))),
    "context-allgather": ("gpt", lambda: Strategy(par.make_mesh("context=2,tensor=2,fsdp=2"), "fsdp+tp",
                                                  parts=(Context("allgather", block=4),))),
    "context-ulysses": ("llama", lambda: Strategy(par.make_mesh("context=2,data=4"), "dp",
                                                  parts=(Context("ulysses"),))),
    "pipeline-gpipe": ("gpt", lambda: ParallelFlags.parse("pipeline=4,data=2", "dp", pipeline="gpipe", microbatches=4)),
    "pipeline-1f1b": ("llama", lambda: ParallelFlags.parse("pipeline=2,data=4", "dp", pipeline="1f1b", microbatches=2)),
    "pipeline-interleaved": ("llama", lambda: ParallelFlags.parse("pipeline=2,data=2,tensor=2", "tp",
                                                             pipeline="interleaved", microbatches=2)),
    "pipeline-zero2": ("gpt", lambda: ParallelFlags.parse("pipeline=2,data=4", "dp", pipeline="1f1b", microbatches=2,
                                                     zero=2)),
    "expert": ("moe", lambda: ParallelFlags.parse("expert=8", "dp")),
    "expert-data": ("moe", lambda: ParallelFlags.parse("expert=4,data=2", "dp")),
    "expert-fsdp-tp": ("moe", lambda: ParallelFlags.parse("expert=2,fsdp=2,tensor=2", "fsdp+tp")),
    # MoE with the sequence split (zigzag: the capacity path must serve tokens by true position)
    # and on the manual path; the loss holds the router losses, `moe_balance` is compared too.
    "moe-context-ring": ("moe", lambda: Strategy(par.make_mesh("context=4,data=2"), "dp",
                                                 parts=(Context("ring", block=4),))),
    "moe-context-allgather": ("moe", lambda: Strategy(par.make_mesh("context=2,tensor=2,fsdp=2"), "fsdp+tp",
                                                      parts=(Context("allgather", block=4),))),
    "moe-context-ulysses": ("moe", lambda: Strategy(par.make_mesh("context=2,data=4"), "dp",
                                                    parts=(Context("ulysses"),))),
    "moe-context-expert": ("moe", lambda: Strategy(par.make_mesh("context=2,expert=2,data=2"), "dp",
                                                   parts=(Context("ring", block=4),))),
    "moe-manual-dp": ("moe", lambda: ParallelFlags.parse("data=8", "dp", manual=True)),
    "moe-manual-tp": ("moe", lambda: ParallelFlags.parse("data=4,tensor=2", "dp+tp", manual=True)),  # 2 heads
}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """`first_step(name, Strategy())` of each model, computed once for all xdist workers: the
    first worker to need it writes it to a folder they share, the others read it."""
    root = shared_dir(tmp_path_factory, "gradient-parity")
    root.mkdir(exist_ok=True)

    @functools.cache
    def reference(name: str) -> dict:
        path = root / f"{name}.pickle"
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                path.with_suffix(".tmp").write_bytes(pickle.dumps(first_step(name, Strategy())))
                path.with_suffix(".tmp").rename(path)
        return pickle.loads(path.read_bytes())

    return reference


@pytest.mark.parametrize("case", list(CASES))
def test_first_step_gradients_equal_one_device(case, one_device):
    name, make = CASES[case]
    want = one_device(name)
    assert want["grad_norm"] > 2 * CLIP  # clipping acts, so the clipped gradients test the global norm
    err = errors(first_step(name, make()), want)
    bad = {k: f"{v:.2e}" for k, v in sorted(err.items(), key=lambda kv: -kv[1]) if v > TOL}
    worst = max(err.values())
    assert not bad, (f"{case}: {len(bad)} of {len(err)} differ from one device beyond {TOL:g} "
                     f"[margin {worst / TOL:.3g}x]: {bad}")
