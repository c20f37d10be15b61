"""Test data that can show learning: token windows drawn from a fixed random Markov chain.

Each token has `branching` likely successors (a sparse random transition table, the
same for every call), so the chain's entropy is far below ln(vocab): a model that
learns anything brings the loss down from ln(vocab) towards it, and a loss that
does not fall is a failure rather than chance (uniform tokens keep the loss at
ln(vocab) whatever the model does).
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def transitions(vocab: int, branching: int = 4, seed: int = 0) -> np.ndarray:
    """`[vocab, vocab]` next-token probabilities: `branching` successors per token, random weights."""
    rng = np.random.default_rng(seed)
    table = np.zeros((vocab, vocab))
    for t in range(vocab):
        table[t, rng.choice(vocab, branching, replace=False)] = rng.dirichlet(np.ones(branching))
    return table


def entropy_rate(vocab: int, branching: int = 4, seed: int = 0) -> float:
    """The chain's entropy per token (nats) under its stationary distribution: the loss floor."""
    table = transitions(vocab, branching, seed)
    values, vectors = np.linalg.eig(table.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    pi = pi / pi.sum()
    logs = np.log(np.where(table > 0, table, 1.0))
    return float(-np.sum(pi[:, None] * table * logs))


# The least fall over 5 AdamW steps (lr 1e-3) that counts as learning: the parity tests' tiny
# models drop 0.11 (Llama) and 0.15 (GPT-2) on this chain, and 0.005 and 0.018 on uniform tokens.
MIN_FALL = 0.05


def falls(losses, by: float = MIN_FALL) -> bool:
    """Whether the last loss is at least `by` below the first."""
    return losses[-1] < losses[0] - by


def markov_windows(seed: int, rows: int, length: int, vocab: int, branching: int = 4) -> np.ndarray:
    """`[rows, length + 1]` int32 windows of the chain, the start tokens and steps drawn from `seed`."""
    rng = np.random.default_rng(seed)
    cumulative = np.cumsum(transitions(vocab, branching), axis=1)
    out = np.empty((rows, length + 1), np.int32)
    out[:, 0] = rng.integers(0, vocab, rows)
    for i in range(1, length + 1):
        u = rng.random(rows)[:, None]
        out[:, i] = np.minimum((u > cumulative[out[:, i - 1]]).sum(axis=1), vocab - 1)
    return out

