"""Packed documents: the plan, the batch, and a packed document trains exactly as it would alone."""

import equinox as eqx
import jax
import numpy as np
import pytest

import eqgpt
from eqgpt.data import Batch
from eqgpt.data.packing import PackedLoader, document_pieces, pack_documents, packed_windows, packing_efficiency
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


# ---------------------------------------------------------------- found by mutation testing (data/packing.py)

def best_fit_decreasing(lengths: list[int], cap: int) -> list[list[int]]:
    """An independent best-fit-decreasing: full pieces alone first; then the other pieces longest first (ties
    in document order), each into the open row with the least room that fits it (ties: the row that reached
    that room last), else a new row."""
    rows = [[i] for i, n in enumerate(lengths) if n == cap]
    bins, room, stamp = [], [], []
    short = sorted((i for i, n in enumerate(lengths) if n < cap), key=lambda i: -lengths[i])
    for t, i in enumerate(short):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        b = min(fits, key=lambda b: (room[b], -stamp[b])) if fits else len(bins)
        if b == len(bins):
            bins.append([]), room.append(cap), stamp.append(0)
        bins[b].append(i)
        room[b] -= lengths[i]
        stamp[b] = t
    return rows + bins


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_is_best_fit_decreasing_with_ties_in_document_order(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.choice([0, 1, 2, 3, 5, 8, 8, 12, 15, 16, 17, 17, 40], 120)  # ties, splits, rows left with 2
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    starts, pieces = document_pieces(bounds, 16)
    rows = best_fit_decreasing(pieces.tolist(), 17)
    plan = pack_documents(bounds, 16)
    assert plan.row_ptr.tolist() == np.cumsum([0] + [len(r) for r in rows]).tolist()
    assert plan.starts.tolist() == [int(starts[i]) for r in rows for i in r]


def test_a_row_left_with_two_slots_takes_a_two_token_piece_and_equal_rooms_stay_open():
    assert pack_documents(np.cumsum([0, 31, 2]), SEQ).num_rows == 1  # 33 slots: 31 + 2
    assert pack_documents(np.cumsum([0, 30, 30, 2, 2]), SEQ).num_rows == 2  # both rows of room 3 take a 2
    assert pack_documents(np.cumsum([0, 20, 13, 13, 20]), SEQ).num_rows == 2  # longest first: 20 + 13 twice


def test_packed_rows_hold_their_pieces_exactly():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 45, 60)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(1, 1000, bounds[-1]).astype(np.int32)
    plan = pack_documents(bounds, SEQ)
    rows = np.arange(plan.num_rows)
    out, seg, pos, has_target = packed_windows(tokens, plan, rows)
    assert has_target.dtype == np.float32 and set(np.unique(has_target).tolist()) <= {0.0, 1.0}
    for r in rows:
        k0, k1 = plan.row_ptr[r], plan.row_ptr[r + 1]
        pieces = [tokens[s:s + n] for s, n in zip(plan.starts[k0:k1], plan.lengths[k0:k1], strict=True)]
        used = sum(len(p) for p in pieces)
        assert out[r, :used].tolist() == np.concatenate(pieces).tolist() and not out[r, used:].any()
        assert seg[r, :used].tolist() == [j + 1 for j, p in enumerate(pieces) for _ in p]  # 1, 2, ... per row
        assert pos[r, :used].tolist() == [i for p in pieces for i in range(len(p))]
        assert has_target[r, :used].tolist() == [float(i < len(p) - 1) for p in pieces for i in range(len(p))]
        assert not (seg[r, used:].any() or pos[r, used:].any() or has_target[r, used:].any())


def test_fill_efficiency_and_split_count_on_a_small_plan(caplog):
    bounds = np.cumsum([0, 5, 1, 70, 33])  # 70 tokens split in three; 33 = seq_len + 1 is not split
    with caplog.at_level("INFO", logger="eqgpt.data.packing"):
        plan = pack_documents(bounds, SEQ)
    assert plan.split_docs == 1 and plan.num_rows == 4
    assert plan.fill() == pytest.approx((5 + 33 + 33 + 6 + 33) / (4 * 33))
    assert caplog.messages == ["packing: 1 of 4 documents are longer than seq_len + 1 = 33 tokens; they are split "
                               "into pieces of 33 tokens (overlapping by one), positions restarting per piece."]
    tokens = np.arange(1, bounds[-1] + 1, dtype=np.int32)
    loader = PackedLoader(tokens, bounds, batch_size=4, seq_len=SEQ)
    # the inputs (each row's first 32 slots): three full rows, and one of 5 + 6 tokens with 4 + 5 targets
    assert packing_efficiency(loader.local_batch(0)) == {"real": (3 * 32 + 11) / 128, "trained": (3 * 32 + 9) / 128}


def test_bounds_of_any_integer_dtype_give_the_same_pieces():
    bounds = np.cumsum([0, 5, 1, 70])
    expected = [a.tolist() for a in document_pieces(bounds, SEQ)]
    for dtype in (np.uint16, np.uint32, np.int32):
        assert [a.tolist() for a in document_pieces(bounds.astype(dtype), SEQ)] == expected


def test_bad_packing_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"^seq_len must be positive, got 0\.$"):
        pack_documents(np.array([0, 5]), 0)
    with pytest.raises(ValueError, match=r"^no document has 2 or more tokens: nothing to pack; add text or use "
                                         r"mode='windows'\.$"):
        pack_documents(np.array([0, 1, 2]), SEQ)
    tokens = np.arange(10, dtype=np.int32)
    for batch_size, seq_len in ((0, SEQ), (2, 0)):
        with pytest.raises(ValueError, match=rf"^batch_size and seq_len must be positive, got {batch_size}, "
                                             rf"{seq_len}\.$"):
            PackedLoader(tokens, np.array([0, 10]), batch_size=batch_size, seq_len=seq_len)
    with pytest.raises(ValueError, match=r"^document boundaries end at 9, but there are 10 tokens\.$"):
        PackedLoader(tokens, np.array([0, 4, 9]), batch_size=2, seq_len=SEQ)


def test_packed_loader_state_windows_and_default_seed():
    rng = np.random.default_rng(2)
    bounds = np.concatenate([[0], np.cumsum(rng.integers(2, 50, 100))])
    tokens = rng.integers(1, 256, bounds[-1]).astype(np.int32)
    loader = PackedLoader(tokens, bounds, batch_size=4, seq_len=SEQ)
    assert np.array_equal(loader.local_batch(5).tokens, PackedLoader(tokens, bounds, batch_size=4, seq_len=SEQ,
                                                                     seed=0).local_batch(5).tokens)
    windows, batch = loader.local_windows(5), loader.local_batch(5)
    assert windows.shape == (4, SEQ + 1)
    assert np.array_equal(windows[:, :-1], batch.tokens) and np.array_equal(windows[:, 1:], batch.targets)
    state = loader.state(7)
    assert state == {"seed": 0, "step": 7, "mode": "packed", "batch_size": 4, "seq_len": SEQ}
    assert loader.restore(state) == 7
    with pytest.raises(ValueError, match=r"^the checkpoint's data pipeline differs from this run's: batch_size was "
                                         r"8, now 4; resume"):
        loader.restore({**state, "batch_size": 8})
    with pytest.raises(ValueError, match=r"mode was 'windows', now 'packed'"):
        loader.restore({**state, "mode": "windows"})
