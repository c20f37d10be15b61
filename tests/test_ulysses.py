"""Ulysses context parallelism equals one device: `recipes/train_gpt.py --context ulysses`,
the compiled all-to-alls, a checkpoint restored on one device, and bad head counts.

Every run trains the `llama-nano` preset, shrunk: 4 query heads sharing 2 kv heads
(GQA; on `context=4` the kv heads are replicated). `context=4,data=2` trains on packed
documents shorter and longer than a row (`--data.mode packed`: document masks, with
documents crossing shard boundaries); the pipeline does not take packed batches yet,
so the other two meshes train on plain windows (causal mask only).
"""

from __future__ import annotations

import numpy as np
import pytest
import tyro

import eqgpt
from eqgpt.parallel import Strategy, make_mesh
from eqgpt.parallel.context import Context, ulysses_bytes
from eqgpt.parallel.flags import tyro_registry
from eqgpt.profile import collectives
from helpers import compiled_step
from recipe_runs import TINY, load_recipe, run_once, seed_checkpoint, shared_corpus, write_documents

STEPS = 5
MODEL = [*TINY, "--model.preset", "llama-nano", "--model.num-heads", "4"]
MESHES = {  # mesh: (data mode, flags)
    "context=4,data=2": ("packed", ["--context", "ulysses"]),
    "context=2,fsdp=2,tensor=2": ("windows", ["--context", "ulysses", "--strategy", "fsdp+tp"]),
    "pipeline=2,context=2,data=2": ("windows", ["--context", "ulysses", "--pipeline", "1f1b", "--microbatches", "2"]),
}
SAVED = "context=4,data=2"  # checkpoints after step 3; restored on one device below


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return shared_corpus(tmp_path_factory, "ulysses")


def losses(root, mesh=None, mode="packed"):
    """The run on `mesh` (None: one device, in data `mode`); `SAVED` checkpoints after step 3."""
    if mesh is None:
        return run_once(root, f"one-{mode}", [*MODEL, "--steps", str(STEPS), "--data.mode", mode])
    mode, flags = MESHES[mesh]
    extra = ["--checkpoint-every", "3"] if mesh == SAVED else []
    return run_once(root, mesh, [*MODEL, "--steps", str(STEPS), "--data.mode", mode, "--mesh", mesh, *flags, *extra])


@pytest.mark.parametrize("mesh", list(MESHES))
def test_ulysses_training_equals_one_device(corpus, mesh):
    got, want = losses(corpus, mesh), losses(corpus, mode=MESHES[mesh][0])
    assert len(got) == len(want) == STEPS and want[-1]["loss"] < want[0]["loss"]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=1e-5)


def test_ulysses_checkpoint_restores_on_one_device(corpus):
    """The step-3 checkpoint of the `context=4,data=2` run, resumed on one device: steps 4
    and 5 equal the uninterrupted run's."""
    losses(corpus, SAVED)
    seed_checkpoint(corpus, SAVED, "resume-one")
    resumed = run_once(corpus, "resume-one", [*MODEL, "--steps", str(STEPS), "--data.mode", "packed", "--resume"])
    assert [r["step"] for r in resumed] == [4, 5]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in losses(corpus)[3:]], rtol=2e-5)


def test_compiled_step_has_four_all_to_alls_per_attention_layer_of_the_analytic_size():
    """q, k, v to head-sharded and the output back: four all-to-alls over `context` per layer
    forward (and their four transposes backward), each sending `(n-1)/n` of its block."""
    config = eqgpt.preset("llama-nano", vocab_size=64, num_layers=2, embed_dim=32, num_heads=4, seq_len=32)
    strategy = Strategy(make_mesh("context=4,data=2"), "dp", parts=(Context("ulysses"),))
    compiled, _ = compiled_step(config, strategy)
    rows = [r for r in collectives(compiled, strategy.mesh) if r.kind == "all-to-all"]
    n, layers, head_dim = 4, config.num_layers, config.embed_dim // config.num_heads
    forward = [r for r in rows if r.phase == "forward"]
    assert len(forward) == 4 and len(rows) == 8
    assert all(r.axes == ("context",) and r.executions == layers for r in rows)  # once per layer of the scan
    sent = ulysses_bytes(rows=4, seq=config.seq_len, num_heads=4, num_kv_heads=config.num_kv_heads,
                         head_dim=head_dim, n=n)  # 8 rows over data=2: 4 on each device
    assert sum(r.total_bytes for r in forward) * (n - 1) / n == layers * sent
    assert sum(r.total_bytes for r in rows) * (n - 1) / n == 2 * layers * sent


def test_heads_not_divisible_by_context_fail_before_compiling(tmp_path):
    args = [*MODEL, "--data.corpus", str(write_documents(tmp_path / "docs", n=4)), "--steps", "1",
            "--out-dir", str(tmp_path / "run"), "--mesh", "context=4,data=2", "--context", "ulysses",
            "--model.num-heads", "2"]
    with pytest.raises(ValueError, match=r"--context ulysses splits the 2 attention heads over the 4 devices"):
        load_recipe().main(tyro.cli(load_recipe().TrainConfig, registry=tyro_registry(), args=args))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran
