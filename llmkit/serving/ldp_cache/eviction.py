"""Eviction policies for the edge cache: LRU (baseline) and LDPCache's multi-factor policy.

The multi-factor policy (paper: "balances query diversity, response accuracy, and
recency") keeps the entries with the highest

    keep(i) = w_div * diversity(i) + w_acc * accuracy(i) + w_rec * recency(i)

and evicts the lowest, where
    diversity(i) = 1 - max_{j != i} cos(e_i, e_j)   (a near-duplicate of another entry adds
                   little coverage of the query space, so it goes first),
    accuracy(i)  = the entry's estimated response accuracy in [0, 1],
    recency(i)   = 2 ** (-(now - last_used) / half_life), on a logical clock of queries.
The abstract gives the three factors but not how they are combined; the weighted
sum and the half-life form are ours (defaults 1, 1, 1 and half_life = capacity).
The newest entry is never the victim: it has just been paid for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EntryView:
    """What a policy may look at: per-entry arrays, aligned by row."""

    embeddings: np.ndarray  # (n, d), unit norm
    accuracy: np.ndarray  # (n,)
    last_used: np.ndarray  # (n,) logical clock
    created: np.ndarray  # (n,)
    now: int


class LRUPolicy:
    name = "lru"

    def victim(self, view: EntryView, newest: int) -> int:
        order = np.lexsort((view.created, view.last_used))  # oldest use first, ties by age
        return int(next(i for i in order if i != newest))


class MultiFactorPolicy:
    name = "multifactor"

    def __init__(self, w_diversity: float = 1.0, w_accuracy: float = 1.0, w_recency: float = 1.0,
                 half_life: float | None = None):
        self.w = (float(w_diversity), float(w_accuracy), float(w_recency))
        self.half_life = half_life

    def scores(self, view: EntryView) -> np.ndarray:
        n = len(view.accuracy)
        if n > 1:
            sim = view.embeddings @ view.embeddings.T
            np.fill_diagonal(sim, -np.inf)
            diversity = np.clip(1.0 - sim.max(axis=1), 0.0, 1.0)
        else:
            diversity = np.ones(n)
        half_life = self.half_life or max(n, 1)
        recency = np.exp2(-(view.now - view.last_used) / half_life)
        wd, wa, wr = self.w
        return wd * diversity + wa * np.clip(view.accuracy, 0.0, 1.0) + wr * recency

    def victim(self, view: EntryView, newest: int) -> int:
        s = self.scores(view)
        s[newest] = np.inf
        return int(np.argmin(s))


def make_policy(name: str, **kw):
    if name in ("multifactor", "multi-factor"):
        return MultiFactorPolicy(**kw)
    if name == "lru":
        return LRUPolicy()
    raise ValueError(f"unknown eviction policy {name!r} (choose multifactor or lru)")
