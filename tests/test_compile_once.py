"""Each program of a recipe run compiles once: with validation, a checkpoint, a resume and samples.

Counted with `eqgpt.profile.compiles.CompileLog` (jax.monitoring's backend-compile event, by
function name). Both runs go in this process; each builds its programs afresh (the eval and
sampling programs compiled ahead, `eqgpt.train.ahead`), so each counts its own.
"""

import os
import subprocess
import sys

import pytest
import tyro

from eqgpt.profile.compiles import CompileLog
from recipe_runs import RECIPES, TINY, load_recipe, shared_corpus

# Eager operations dispatched one at a time compile once per operand shape and dtype:
# a second compile under these names is a new shape, not a repeated program.
NEW_SHAPES = {
    "stage": "jnp.asarray of a host array (the seed, a checkpoint's arrays, the prompt rows): one per shape",
    "add": "the learning-rate schedule's arithmetic on a Python step number and on a traced one",
}


@pytest.mark.slow
def test_every_program_compiles_once(tmp_path_factory, tmp_path):
    corpus = shared_corpus(tmp_path_factory, "compile-once")
    recipe = load_recipe()
    args = list(TINY)
    args[args.index("--sample-tokens") + 1] = "8"  # the default prompts: 'def ', 'class ', 'import '
    args += ["--data.corpus", str(corpus / "docs" / "*.py"), "--out-dir", str(tmp_path / "run"),
             "--eval-every", "3", "--checkpoint-every", "3"]
    for steps, more in ((6, []), (9, ["--resume"])):
        with CompileLog() as log:
            summary = recipe.main(tyro.cli(recipe.TrainConfig, args=args + ["--steps", str(steps), *more]))
        assert summary["steps"] == steps and len(summary["samples"]) == 3
        repeated = {name: n for name, n in log.repeated().items() if name not in NEW_SHAPES}
        assert not repeated, f"compiled more than once in one run: {repeated} (all: {dict(log.counts)})"
        assert log.counts["step"] == 1 and log.counts["evaluate"] == 1, dict(log.counts)
        if not more:  # three prompts of 4, 6 and 7 tokens: one sampling program
            assert log.counts["_generate_rows"] == 1, dict(log.counts)
            assert set(summary["compile_seconds"]) == {"train", "eval", "sample", "other"}


@pytest.mark.slow
def test_eqgpt_sample_reads_the_program_the_trainer_compiled(tmp_path_factory, tmp_path):
    """The trainer's end-of-run samples (3 prompts) and `eqgpt-sample` (2 samples of one prompt,
    more tokens) run one program: the persistent cache holds one sampler after both."""
    corpus = shared_corpus(tmp_path_factory, "compile-once")
    env = {k: v for k, v in os.environ.items() if k not in ("EQGPT_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["EQGPT_CACHE"] = str(tmp_path / "cache")
    args = list(TINY)
    args[args.index("--sample-tokens") + 1] = "8"
    args.remove("--model.scan-layers")  # unrolled layers, as gpt2-small trains on a TPU: both sample scanned
    train = [sys.executable, str(RECIPES / "train_gpt.py"), *args, "--steps", "2", "--eval-windows", "0",
             "--data.corpus", str(corpus / "docs" / "*.py"), "--out-dir", str(tmp_path / "run")]
    subprocess.run(train, env=env, check=True, capture_output=True, timeout=600)
    sampler = [sys.executable, str(RECIPES / "sample.py"), "--run-dir", str(tmp_path / "run"), "--prompt", "x = ",
               "--max-new-tokens", "20"]
    out = subprocess.run(sampler, env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    assert out.count("--- sample") == 2
    entries = [p.name for p in (tmp_path / "cache" / "xla").iterdir() if "generate_rows" in p.name]
    assert len([e for e in entries if not e.endswith("-atime")]) == 1, entries


@pytest.mark.parametrize("mesh", [None, "data=2,fsdp=2,tensor=2"])
def test_make_train_step_compiles_once_from_a_fresh_state(mesh):
    """A user's loop: a freshly built state (uncommitted key and counters, placed specs with trailing
    `None`s) and three steps of the jitted `make_train_step`: one program. Without `Strategy.settle`
    the second step compiled again, as the state the first returned spelled its layout differently."""
    import jax
    import numpy as np

    import eqgpt
    from eqgpt.data import Batch
    from eqgpt.parallel import ParallelFlags
    from eqgpt.train import Strategy, TrainState, make_lr_schedule, make_optimizer, make_train_step

    strategy = ParallelFlags.parse(mesh, "dp+fsdp+tp") if mesh else Strategy()
    optimizer = make_optimizer(make_lr_schedule(1e-3, total_steps=10, warmup_steps=0))
    model = strategy.place_model(eqgpt.nn.GPT(eqgpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=2,
                                                              embed_dim=16), key=jax.random.key(0)))
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(0))
    step = make_train_step(optimizer, strategy=strategy, model_like=model)
    batch = strategy.batch(Batch.from_windows(np.arange(8 * 17, dtype=np.int32).reshape(8, 17) % 64))
    with CompileLog() as log:
        for _ in range(3):
            state, metrics = step(state, batch)
    assert log.counts["step"] == 1, dict(log.counts)
    assert np.isfinite(float(metrics["loss"]))
