"""The batches a user's code builds, under each strategy: `Batch` without a loss mask, and with
segment ids and per-document positions (packed documents) with and without a loss mask.

`tests/test_gradient_parity.py` checks every strategy on a batch with a loss mask only (the
recipe's windows carry none, the packed loader all three fields). Here one step of each
strategy family on the other layouts gives the loss and the gradients of one device on the
same batch (its helpers, its tolerance). A strategy that ignored `segment_ids`, that took a
missing mask for another normalisation, or that dropped `positions` fails by its margin.
"""

import functools

import numpy as np
import pytest

from eqgpt.data import Batch
from eqgpt.train import Strategy
from test_gradient_parity import CASES, TOL, batch, errors, first_step


def packed(with_mask: bool) -> Batch:
    """The parity batch as packed rows: three documents per row (lengths differ by row); with the
    mask (the packed loader's batch) also each piece's positions restarting at 0."""
    b = batch()
    rows, seq = b.shape
    seg, pos = np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = [0, 5 + r, 17 + r // 2, seq]
        for s in range(3):
            seg[r, cuts[s]:cuts[s + 1]] = s + 1
            pos[r, cuts[s]:cuts[s + 1]] = np.arange(cuts[s + 1] - cuts[s])
    mask = None
    if with_mask:  # the packed loader's mask: no target across a document boundary, uneven per row
        mask = np.asarray(b.loss_mask) * np.concatenate([seg[:, 1:] == seg[:, :-1], np.ones((rows, 1), bool)], 1)
    return Batch(b.tokens, b.targets, loss_mask=mask, segment_ids=seg, positions=pos if with_mask else None)


LAYOUTS = {
    "no-mask": lambda: Batch(batch().tokens, batch().targets),
    "segments": lambda: packed(False),
    "packed": lambda: packed(True),
}

# One case per family: each reads the batch its own way (sharded rows, sequence shards, layouts of
# the context split, pipeline microbatches, expert dispatch, the manual path, ZeRO's blocks).
# "dp+fsdp+tp" stands for the automatic path's three splits (rows over data and fsdp, weights over
# tensor): the partitioner reads the batch one way for all, so one mesh composing them checks them.
FAMILIES = ["dp+fsdp+tp", "sp", "manual-tp", "manual-sp", "zero2-manual", "context-ring", "context-allgather",
            "context-ulysses", "pipeline-1f1b", "expert-data"]


def step_on(layout: str, name: str, strategy):
    return first_step(name, strategy, LAYOUTS[layout])


@functools.cache
def one_device(layout: str, name: str) -> dict:
    """`step_on(layout, name, Strategy())`, computed once per module (its floats and arrays are
    only read)."""
    return step_on(layout, name, Strategy())


# Per-row positions are refused, with the fix named, where the path has no support for them yet:
# there segment ids without positions are checked instead ("packed" holds all three fields).
NO_POSITIONS = {"manual-tp", "manual-sp", "pipeline-1f1b"}
RUNS = [(c, "no-mask") for c in FAMILIES] + [(c, "segments" if c in NO_POSITIONS else "packed") for c in FAMILIES]


def test_paths_without_positions_refuse_them():
    for case in sorted(NO_POSITIONS):
        name, make = CASES[case]
        with pytest.raises(ValueError, match=r"Batch.positions .* not supported"):
            step_on("packed", name, make())


@pytest.mark.slow
@pytest.mark.parametrize("case, layout", RUNS, ids=[f"{c}-{lay}" for c, lay in RUNS])
def test_strategy_on_user_batches_equals_one_device(case, layout):
    name, make = CASES[case]
    want = one_device(layout, name)
    err = errors(step_on(layout, name, make()), want)
    bad = {k: f"{v:.2e}" for k, v in sorted(err.items(), key=lambda kv: -kv[1]) if v > TOL}
    worst = max(err.values())
    assert not bad, f"{case} on {layout}: {len(bad)} of {len(err)} differ [margin {worst / TOL:.3g}x]: {bad}"


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_layouts_change_the_gradients(name):
    """The layouts differ where they should (so agreeing on them means something): segment ids,
    and then positions and the mask, each change one device's gradients by far more than `TOL`."""
    steps = [one_device(k, name) for k in LAYOUTS]
    for a, b in zip(steps, steps[1:], strict=False):
        assert max(errors(a, b).values()) > 100 * TOL

