"""Each program of a recipe run compiles once: with validation, a checkpoint, a resume and samples.

Counted with `eqgpt.profile.compiles.CompileLog` (jax.monitoring's backend-compile event, by
function name). Both runs go in this process, so the resumed run's sampler, unchanged, is
served by the first run's in-memory cache; the train and eval steps are built afresh.
"""

import pytest
import tyro

from eqgpt.profile.compiles import CompileLog
from recipe_runs import TINY, load_recipe, shared_corpus

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
