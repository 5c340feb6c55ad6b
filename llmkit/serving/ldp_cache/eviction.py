"""Eviction policies for the edge cache: LRU (baseline) and LDPCache's multi-factor policy.

The multi-factor policy (paper: "balances query diversity, response accuracy, and
recency") keeps the entries with the highest

    keep(i) = w_div * diversity(i) + w_acc * accuracy(i) + w_rec * recency(i)

and evicts the lowest, where
    diversity(i) = min(1, (1 - max_{j != i} cos(e_i, e_j)) / radius), radius = 1 - the
                   scheduler's similarity threshold: an entry within the hit radius of another
                   is (partly) redundant, since queries that would hit it mostly hit the other
                   too; entries farther apart than the radius all count as fully diverse,
    accuracy(i)  = the entry's estimated response accuracy in [0, 1],
    recency(i)   = 2 ** (-(now - last_used) / half_life), on a logical clock of queries.
The abstract gives the three factors but not how they are combined; the weighted
sum, the radius scaling and the half-life form are ours (defaults 1, 1, 1, radius 0.2,
half_life = 2 x capacity). Scaling diversity by the hit radius matters: raw
1 - max cos differs little between distinct GSM8K problems (0.3-0.7) and the
recency term would then decide almost alone, making the policy LRU with noise.
The newest entry is never the victim: it has just been paid for.

Measured (bench/ldp_cache.py, MiniLM embeddings, GSM8K templated variants, uniform and
Zipf workloads; bench/results/ldp_cache*.json): with these defaults the multi-factor
policy does NOT beat LRU: 0.008-0.021 lower hit ratio at capacities 2-6, equal at 8-12.
The ablation (--eviction-ablation) puts it on the diversity term (without it the policy
is within 0.004 of LRU; recency alone is LRU). Our reading: entries inside one another's
hit radius are variants of the problem being asked right now, and they are not
redundant, because a hit also needs accuracy x similarity high enough for the gain test,
which a closer variant passes and a farther one does not; penalising them evicts the hot
problem's entries in favour of cold ones. Not tuned further (no held-out workload).
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
                 half_life: float | None = None, radius: float = 0.2):
        if not 0.0 < radius <= 2.0:
            raise ValueError(f"radius must be in (0, 2], got {radius}")
        self.w = (float(w_diversity), float(w_accuracy), float(w_recency))
        self.half_life = half_life
        self.radius = float(radius)

    def scores(self, view: EntryView) -> np.ndarray:
        n = len(view.accuracy)
        if n > 1:
            sim = view.embeddings @ view.embeddings.T
            np.fill_diagonal(sim, -np.inf)
            diversity = np.clip((1.0 - sim.max(axis=1)) / self.radius, 0.0, 1.0)
        else:
            diversity = np.ones(n)
        half_life = self.half_life or 2.0 * max(n - 1, 1)
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
