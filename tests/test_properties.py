"""Property-based tests (Hypothesis) where the input space is the point: masks, packing and
loader windows, the learning-rate schedule over a whole run, and the validation mean.

Each property is checked against a definition written here or in `tests/references.py`,
for inputs Hypothesis draws (bounded: `EXAMPLES` per test, no deadline: the first call of a
JAX function compiles). Shrinking reports the smallest failing case.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import references as ref
from eqgpt.data.batch import Batch
from eqgpt.data.loader import BatchLoader, eval_windows
from eqgpt.data.packing import PackedLoader, document_pieces, pack_documents, packed_windows
from eqgpt.nn.mask import CausalMask, DocumentMask, FullMask, SlidingWindowMask, make_mask
from eqgpt.train.optim import make_lr_schedule
from eqgpt.train.trainer import Trainer, TrainerConfig, make_eval_fn
from helpers import unchecked

EXAMPLES = 40
bounded = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
fewer = settings(bounded, max_examples=EXAMPLES // 2)  # each example compiles for new shapes

# ------------------------------------------------------------------------------------ masks

positions = st.lists(st.integers(0, 40), min_size=1, max_size=12)


@pytest.mark.slow
@bounded
@given(q=positions, k=positions, window=st.integers(1, 12))
def test_masks_are_their_definitions_at_any_positions(q, k, window):
    qp, kp = jnp.asarray(q), jnp.asarray(k)
    np.testing.assert_array_equal(CausalMask()(qp, kp), ref.causal_mask(q, k))
    np.testing.assert_array_equal(SlidingWindowMask(window)(qp, kp), ref.sliding_window_mask(q, k, window))
    np.testing.assert_array_equal(make_mask("sliding", window)(qp, kp), ref.sliding_window_mask(q, k, window))
    np.testing.assert_array_equal(FullMask()(qp, kp), np.ones((len(q), len(k)), bool))
    # Block skipping is sound: a block with any allowed pair is never skipped.
    for mask, want in ((CausalMask(), ref.causal_mask(q, k)),
                       (SlidingWindowMask(window), ref.sliding_window_mask(q, k, window))):
        if want.any():
            assert bool(mask.block_may_attend(qp, kp))


@bounded
@given(q0=st.integers(0, 60), q_len=st.integers(1, 16), k0=st.integers(0, 60), k_len=st.integers(1, 16),
       window=st.integers(1, 20))
def test_block_skipping_is_exact_for_contiguous_blocks(q0, q_len, k0, k_len, window):
    """For the contiguous blocks kernels use, a block is skipped exactly when no pair may attend."""
    q, k = np.arange(q0, q0 + q_len), np.arange(k0, k0 + k_len)
    for mask, want in ((CausalMask(), ref.causal_mask(q, k)),
                       (SlidingWindowMask(window), ref.sliding_window_mask(q, k, window)),
                       (FullMask(), np.ones((q_len, k_len), bool))):
        assert bool(mask.block_may_attend(jnp.asarray(q), jnp.asarray(k))) == bool(want.any()), mask


@st.composite
def segment_layouts(draw):
    """`[batch, seq]` segment ids: runs of documents, ids increasing, 0-padding at the end."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    rows = []
    for _ in range(batch):
        ids, doc = [], 1
        while len(ids) < seq:
            ids += [doc] * draw(st.integers(1, seq))
            doc += 1
        pad = draw(st.integers(0, seq - 1))
        rows.append(ids[: seq - pad] + [0] * pad)
    return np.asarray(rows, np.int32)


@pytest.mark.slow
@bounded
@given(seg=segment_layouts(), window=st.integers(1, 12))
def test_document_masks_are_their_definition(seg, window):
    t = seg.shape[1]
    pos = np.arange(t)
    doc = ref.document_mask(seg, seg)
    for inner, within in ((None, ref.causal_mask(pos, pos)), (SlidingWindowMask(window),
                                                             ref.sliding_window_mask(pos, pos, window)),
                          (FullMask(), np.ones((t, t), bool))):
        got = DocumentMask(inner)(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg))
        np.testing.assert_array_equal(got, within[None] & doc)
        # Any mask honours segment ids the same way.
        plain = CausalMask() if inner is None else inner
        np.testing.assert_array_equal(plain(jnp.asarray(pos), jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(seg)),
                                      got)


def test_masks_by_name_and_bad_masks():
    assert isinstance(make_mask("causal"), CausalMask) and isinstance(make_mask("full"), FullMask)
    assert make_mask("sliding", window=3) == SlidingWindowMask(3)
    with pytest.raises(ValueError, match="needs a window"):
        make_mask("sliding")
    with pytest.raises(ValueError, match="choose"):
        make_mask("Causal")
    pos = jnp.arange(3)
    with pytest.raises(ValueError, match="both"):
        CausalMask()(pos, pos, q_seg=pos[None])
    with pytest.raises(ValueError, match="segment ids"):
        DocumentMask()(pos, pos)
    with pytest.raises(ValueError, match="window >= 1"):
        SlidingWindowMask(0)


# ---------------------------------------------------------------------------------- packing

doc_lengths = st.lists(st.integers(0, 30), min_size=1, max_size=12).filter(lambda ls: any(n >= 2 for n in ls))


def corpus(lengths):
    """Tokens `1..n` (each token names its own place) and the document boundaries."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.arange(1, bounds[-1] + 1, dtype=np.int32), bounds


def trained_pairs(batch_tokens, batch_targets, mask):
    """The (input, target) pairs that count, row by row, left to right."""
    return [(int(a), int(b)) for a, b, m in zip(batch_tokens.ravel(), batch_targets.ravel(), mask.ravel(),
                                                 strict=True) if m]


def document_pairs(tokens, lengths):
    """Every next-token pair of every document, in document order."""
    out, start = [], 0
    for n in lengths:
        out += [(int(tokens[start + i]), int(tokens[start + i + 1])) for i in range(n - 1)]
        start += n
    return out


@bounded
@given(lengths=doc_lengths, seq_len=st.integers(1, 9))
def test_packing_trains_every_target_of_every_document_once(lengths, seq_len):
    tokens, bounds = corpus(lengths)
    plan = pack_documents(bounds, seq_len)
    win, seg, pos, has_target = packed_windows(tokens, plan, np.arange(plan.num_rows))
    b = Batch.from_windows(win)
    pairs = trained_pairs(np.asarray(b.tokens), np.asarray(b.targets), has_target[:, :-1])
    assert sorted(pairs) == sorted(document_pairs(tokens, lengths))  # each once, none across documents
    assert len(pairs) == sum(max(n - 1, 0) for n in lengths)
    for r in range(plan.num_rows):
        ids = seg[r]
        real = ids > 0
        assert (np.diff(ids[real]) >= 0).all() and (ids[~real] == 0).all() and real[: real.sum()].all()
        for s in set(ids[real].tolist()):
            where = np.flatnonzero(ids == s)
            piece = win[r, where]
            assert (np.diff(piece) == 1).all()  # a piece is a run of one document, in order
            assert pos[r, where].tolist() == list(range(len(where)))
            assert has_target[r, where[-1]] == 0 and has_target[r, where[:-1]].all()
    # Pieces of a document, in plan order of their starts, cover it left to right, one token shared.
    starts, lens = document_pieces(bounds, seq_len)
    assert (lens >= 2).all() and (lens <= seq_len + 1).all()
    for d, n in enumerate(lengths):
        mine = (starts >= bounds[d]) & (starts < bounds[d] + n)
        if n < 2:
            assert not mine.any()
            continue
        s, ln = starts[mine], lens[mine]
        assert s[0] == bounds[d] and s[-1] + ln[-1] == bounds[d] + n and (s[1:] == s[:-1] + ln[:-1] - 1).all()


@pytest.mark.slow
@fewer
@given(lengths=doc_lengths, seq_len=st.integers(1, 6), batch_size=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 3))
def test_packed_loader_epoch_is_a_permutation_of_the_rows(lengths, seq_len, batch_size, seed):
    tokens, bounds = corpus(lengths)
    loader = PackedLoader(tokens, bounds, batch_size=batch_size, seq_len=seq_len, seed=seed,
                          process_index=0, process_count=1)
    n = loader.plan.num_rows
    steps = -(-2 * n // batch_size)  # two epochs
    drawn = np.concatenate([loader.row_ids(s) for s in range(steps)])
    assert sorted(drawn[:n].tolist()) == list(range(n)) and sorted(drawn[n: 2 * n].tolist()) == list(range(n))
    # Process shares are the global batch, in order.
    if batch_size > 1:
        halves = [PackedLoader(tokens, bounds, batch_size=batch_size, seq_len=seq_len, seed=seed, process_index=i,
                               process_count=2) for i in range(2)]
        for s in range(steps):
            np.testing.assert_array_equal(np.concatenate([h.row_ids(s) for h in halves]), loader.row_ids(s))
    b = loader.local_batch(0)
    assert b.shape == (batch_size, seq_len)
    assert (np.asarray(b.loss_mask)[np.asarray(b.segment_ids) == 0] == 0).all()


@bounded
@given(n=st.integers(2, 60), seq_len=st.integers(1, 8), batch_size=st.integers(1, 4), step=st.integers(0, 50),
       num_windows=st.integers(1, 9))
def test_loader_windows_are_slices_of_the_tokens(n, seq_len, batch_size, step, num_windows):
    tokens = np.arange(100, 100 + n, dtype=np.int32)
    if n < seq_len + 1:
        with pytest.raises(ValueError, match="fewer than one sequence"):
            BatchLoader(tokens, batch_size=batch_size, seq_len=seq_len)
        with pytest.raises(ValueError, match="fewer than one sequence"):
            eval_windows(tokens, seq_len=seq_len, num_windows=num_windows)
        return
    loader = BatchLoader(tokens, batch_size=batch_size, seq_len=seq_len, seed=1, process_index=0, process_count=1)
    win = loader.local_windows(step)
    assert win.shape == (batch_size, seq_len + 1)
    assert (np.diff(win, axis=1) == 1).all() and win.min() >= 100 and win.max() < 100 + n
    b = loader.local_batch(step)
    np.testing.assert_array_equal(b.targets[:, :-1], b.tokens[:, 1:])
    ev = eval_windows(tokens, seq_len=seq_len, num_windows=num_windows)
    assert ev.shape == (num_windows, seq_len + 1) and (np.diff(ev, axis=1) == 1).all()
    assert ev[0, 0] == 100 and (num_windows == 1 or ev[-1, -1] == 100 + n - 1)  # the first and last token scored
    assert (np.diff(ev[:, 0]) >= 0).all()
    if num_windows * (seq_len + 1) <= n:  # room for all: none overlap
        assert (ev[1:, 0] > ev[:-1, -1]).all()


def test_every_offset_of_the_loader_is_drawn():
    """Random windows reach both ends of the tokens (the last window ends on the last token)."""
    tokens = np.arange(7, dtype=np.int32)
    loader = BatchLoader(tokens, batch_size=4, seq_len=3, seed=0, process_index=0, process_count=1)
    starts = {int(o) for s in range(50) for o in loader.offsets(s)}
    assert starts == set(range(7 - 3))


# -------------------------------------------------------------------------------- schedules


def closed_form_lr(step, lr, total, warmup, ratio):
    """Linear warmup 0 -> lr over `warmup` steps, then cosine lr -> ratio * lr at `total`, flat after."""
    if step < warmup:
        return lr * step / warmup
    if step >= total:
        return lr * ratio
    progress = (step - warmup) / (total - warmup)
    return lr * ratio + (lr - lr * ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@bounded
@given(total=st.integers(1, 3000), warmup_share=st.floats(0, 0.99), lr=st.floats(1e-5, 10.0),
       ratio=st.floats(0.0, 1.0))
def test_learning_rate_at_every_step_of_a_run(total, warmup_share, lr, ratio):
    warmup = min(int(warmup_share * total), total - 1)
    schedule = make_lr_schedule(lr, total_steps=total, warmup_steps=warmup, min_lr_ratio=ratio)
    steps = np.arange(3005)  # every step, and past the end (one shape: compiled once)
    got = np.asarray(schedule(jnp.asarray(steps)), np.float64)
    want = np.asarray([closed_form_lr(int(s), lr, total, warmup, ratio) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * lr)


# ------------------------------------------------------------------------------- evaluation


class _Placement:
    """What `Trainer.validate` needs of a placement: the rows divisor; batches stay on the host."""

    def __init__(self, divisor):
        self.batch_divisor = divisor

    def batch(self, b):
        return b


def token_loss(tokens, targets):
    """A per-token "loss" that differs from token to token (any function would do)."""
    return jnp.sin(tokens * 0.37 + targets * 1.3) + 2.0


def masked_mean_loss(model, batch):
    """A loss as the strategies compute theirs: the mean over the positions the mask counts."""
    del model
    per = token_loss(batch.tokens, batch.targets)
    mask = jnp.ones_like(per) if batch.loss_mask is None else batch.loss_mask
    return jnp.sum(per * mask) / jnp.sum(mask), {}


@pytest.mark.slow
@fewer
@given(windows=st.integers(1, 23), seq_len=st.integers(1, 5), eval_batch=st.integers(1, 12),
       divisor=st.sampled_from([1, 2, 3, 4, 8]))
def test_validation_mean_is_the_mean_over_all_tokens(windows, seq_len, eval_batch, divisor):
    val = np.random.default_rng(windows * 31 + seq_len).integers(0, 64, (windows, seq_len + 1)).astype(np.int32)
    with unchecked():  # a Trainer for its validation alone: no step, state or loader
        trainer = Trainer(None, None, None, _Placement(divisor), val_windows=val,
                          config=TrainerConfig(steps=1, eval_batch_size=eval_batch, progress=False),
                          eval_fn=make_eval_fn(masked_mean_loss))
    want = float(np.mean(np.asarray(token_loss(jnp.asarray(val[:, :-1]), jnp.asarray(val[:, 1:])), np.float64)))
    assert trainer.validate(None) == pytest.approx(want, rel=1e-6)
    assert all(b.shape[0] % divisor == 0 for b, _ in trainer._val)
