"""Packed documents: the plan, the batch, and a packed document trains exactly as it would alone."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqgpt
from eqgpt.data import Batch
from eqgpt.data.packing import PackedLoader, document_pieces, pack_documents, packing_efficiency
from eqgpt.nn import GPT
from eqgpt.parallel.strategy import lm_batch_loss

SEQ = 32


def test_pieces_split_long_documents_with_one_token_overlap():
    bounds = np.array([0, 5, 6, 6 + 70])  # lengths 5, 1 (dropped: no target), 70 (> 33: split)
    starts, lengths = document_pieces(bounds, SEQ)
    assert starts.tolist() == [0, 6, 6 + 32, 6 + 64] and lengths.tolist() == [5, 33, 33, 6]
    # every target of the long document is trained exactly once: 32 + 32 + 5 = 69 = 70 - 1
    assert int((lengths[1:] - 1).sum()) == 69
    plan = pack_documents(bounds, SEQ)
    assert plan.split_docs == 1 and plan.num_rows == 3  # two full rows, one row with 5 + 6 tokens
    with pytest.raises(ValueError, match="nothing to pack"):
        pack_documents(np.array([0, 1, 2]), SEQ)


def test_packed_batch_fields_and_determinism():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 50, 300)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(1, 256, bounds[-1]).astype(np.uint16)
    a = PackedLoader(tokens, bounds, batch_size=8, seq_len=SEQ, seed=1)
    b = a.local_batch(3)
    assert b.shape == (8, SEQ)
    assert jax.tree.all(jax.tree.map(np.array_equal, b, PackedLoader(tokens, bounds, batch_size=8, seq_len=SEQ,
                                                                     seed=1).local_batch(3)))
    assert not np.array_equal(b.tokens, a.local_batch(4).tokens)
    halves = [PackedLoader(tokens, bounds, batch_size=8, seq_len=SEQ, seed=1, process_index=i,
                           process_count=2).local_batch(3) for i in range(2)]
    assert np.array_equal(np.concatenate([h.tokens for h in halves]), b.tokens)
    seg, pos, mask = np.asarray(b.segment_ids), np.asarray(b.positions), np.asarray(b.loss_mask)
    for r in range(8):
        for s in set(seg[r].tolist()) - {0}:
            where = np.flatnonzero(seg[r] == s)
            assert pos[r, where].tolist() == list(range(len(where)))  # positions restart per document
            assert mask[r, where[-1]] == 0 or where[-1] == SEQ - 1  # no target across documents
    assert (mask[seg == 0] == 0).all()  # padding never counts
    # Every row's first epoch: each piece appears exactly once.
    rows = np.concatenate([a.row_ids(s) for s in range(-(-a.plan.num_rows // 8))])[: a.plan.num_rows]
    assert sorted(rows.tolist()) == list(range(a.plan.num_rows))


def test_stdlib_packing_is_at_least_95_percent_real_tokens(tmp_path):
    corpus = eqgpt.data.load_corpus("stdlib")
    loader = PackedLoader(corpus.train, corpus.train_docs, batch_size=16, seq_len=256, seed=0)
    assert loader.plan.fill() > 0.99
    effs = [packing_efficiency(loader.local_batch(s)) for s in range(20)]
    assert min(e["real"] for e in effs) >= 0.95 and min(e["trained"] for e in effs) >= 0.95


def two_documents():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 64, 12), rng.integers(0, 64, 15)
    tokens = np.concatenate([a, b]).astype(np.uint16)
    packed = PackedLoader(tokens, np.array([0, 12, 27]), batch_size=1, seq_len=SEQ, seed=0).local_batch(0)
    assert packed.segment_ids.max() == 2 and packed.tokens[0, 0] in (a[0], b[0])
    return packed, a, b


def doc_alone(packed: Batch, doc: np.ndarray) -> tuple[Batch, Batch]:
    """The document padded alone to SEQ, and the packed batch with only its targets counted."""
    seg = np.asarray(packed.segment_ids)[0]
    first = int(seg[np.flatnonzero(np.asarray(packed.tokens)[0] == doc[0])[0]])
    window = np.zeros((1, SEQ + 1), np.int32)
    window[0, : len(doc)] = doc
    alone = Batch.from_windows(window)
    mask = np.zeros((1, SEQ), np.float32)
    mask[0, : len(doc) - 1] = 1
    alone = Batch(alone.tokens, alone.targets, loss_mask=mask)
    only = Batch(packed.tokens, packed.targets, loss_mask=packed.loss_mask * (packed.segment_ids == first),
                 segment_ids=packed.segment_ids, positions=packed.positions)
    return alone, only


def make_model(position: str):
    cfg = eqgpt.GPTConfig(vocab_size=64, seq_len=SEQ, num_layers=2, num_heads=2, embed_dim=32, position=position)
    return GPT(cfg, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("kernel", ["reference", "blockwise"])
def test_packed_document_equals_document_alone(position, kernel):
    packed, a, b = two_documents()
    model = make_model(position)
    model = eqx.tree_at(lambda m: m.blocks.attn, model, replace_fn=lambda at: at.with_kernel(kernel))
    grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, bt: lm_batch_loss(m, bt)[0]))
    for doc in (a, b):
        alone, only = doc_alone(packed, doc)
        (la, ga), (lp, gp) = grad(model, alone), grad(model, only)
        np.testing.assert_allclose(lp, la, rtol=1e-5)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), gp, ga)
    # Without per-row positions a learned-position model sees the second document at the wrong positions.
    if position == "learned":
        alone, only = doc_alone(packed, b if packed.tokens[0, 0] == a[0] else a)
        wrong = Batch(only.tokens, only.targets, only.loss_mask, only.segment_ids)
        assert abs(float(grad(model, wrong)[0]) - float(grad(model, alone)[0])) > 1e-4


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_packed_document_equals_alone_under_context_parallelism(impl):
    """Ring / all-gather attention on context=4: segment ids keep documents apart across shards,
    and the per-row positions travel through the zigzag layout with the tokens."""
    from eqgpt import parallel as par
    from eqgpt.parallel import Strategy
    from eqgpt.parallel.context import Context

    packed, a, b = two_documents()
    strategy = Strategy(par.make_mesh("context=4,data=2"), "dp", parts=(Context(impl, block=4),))
    single = make_model("rope")
    model = strategy.place_model(single)
    grad_cp = eqx.filter_jit(strategy.grad_fn())
    grad_one = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, bt: lm_batch_loss(m, bt)[0]))
    for doc in (a, b):
        alone, only = doc_alone(packed, doc)
        rows = jax.tree.map(lambda x: np.repeat(np.asarray(x), 2, axis=0), only)  # data=2: two rows
        (l_cp, _), g_cp = grad_cp(model, strategy.batch(rows))
        l_one, g_one = grad_one(single, alone)
        np.testing.assert_allclose(l_cp, l_one, rtol=1e-5)
        cp_leaves = jax.tree.leaves(eqx.filter(g_cp, eqx.is_array))
        one_leaves = jax.tree.leaves(eqx.filter(g_one, eqx.is_array))
        assert len(cp_leaves) == len(one_leaves)
        for x, y in zip(cp_leaves, one_leaves, strict=True):
            np.testing.assert_allclose(np.asarray(x), y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flags", [dict(pipeline="1f1b", microbatches=2), dict(manual=True)],
                         ids=["pipeline", "manual"])
def test_pipeline_and_manual_paths_refuse_per_row_positions(flags):
    from eqgpt.parallel import ParallelFlags

    packed, _, _ = two_documents()
    rows = jax.tree.map(lambda x: np.tile(np.asarray(x), (8, 1)), packed)
    strategy = ParallelFlags.parse("pipeline=2,data=4" if "pipeline" in flags else "data=8", "dp", **flags)
    model = strategy.place_model(make_model("rope"))
    with pytest.raises(ValueError, match="Batch.positions"):  # before anything compiles
        strategy.grad_fn(model_like=model)(model, strategy.batch(rows))


def test_packed_recipe_resumes_bitwise(tmp_path):
    """train_gpt.py --data.mode packed: 8 straight steps == 4 steps + checkpoint + --resume 4 steps."""
    from eqgpt.profile.compiles import CompileLog
    from recipe_runs import TINY, load_recipe, run_recipe, write_documents

    recipe = load_recipe()
    corpus = write_documents(tmp_path / "docs")
    common = [*TINY, "--eval-windows", "0", "--data.corpus", str(corpus), "--data.cache-dir", str(tmp_path / "cache"),
              "--data.val-percent", "20", "--data.mode", "packed", "--seed", "1"]
    loss = lambda rows: [r["loss"] for r in rows if "loss" in r]  # noqa: E731
    with CompileLog() as log:
        straight = loss(run_recipe(recipe, [*common, "--steps", "8", "--out-dir", str(tmp_path / "a")]))
    assert log.counts["step"] == 1, dict(log.counts)  # packed batches too: one program for every step
    first = loss(run_recipe(recipe, [*common, "--steps", "4", "--checkpoint-every", "4",
                                     "--out-dir", str(tmp_path / "b")]))
    resumed = loss(run_recipe(recipe, [*common, "--steps", "8", "--checkpoint-every", "4", "--resume",
                                       "--out-dir", str(tmp_path / "b")]))
    assert len(straight) == 8 and first == straight[:4]
    assert first + resumed[-4:] == straight  # bitwise
    assert straight[-1] < straight[0]
    import json

    data = json.loads((tmp_path / "b" / "checkpoints" / "8" / "meta" / "metadata").read_text())["extras"]["data"]
    assert data["grain"] == {"next_index": 8} and data["mode"] == "packed"  # the iterator state
