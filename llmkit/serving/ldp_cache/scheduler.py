"""The hit/miss scheduler: LDPCache's randomized decision, and a GPTCache-style baseline.

Observable per query (to the upstream and the network): whether a request was sent,
and if so the perturbed query. The hit/miss pattern depends on the raw query (and on
earlier raw queries through the cache), so it must itself satisfy LDP.

``LDPScheduler`` (the paper's scheduler, as we read the abstract):
  1. private bit b = [sim >= sim_threshold and gain <= gain_threshold], computed on the
     device from the raw query, where sim is the cosine similarity to the nearest cached
     query and gain is the expected accuracy gain of a cloud call:
         gain = E[acc | cloud] - E[acc | reuse],  E[acc | reuse] = acc_entry * max(sim, 0),
     acc_entry is the fidelity cos(emb(query), emb(perturbed query)) of the cloud call that
     filled the entry (the device knows both texts; a heavily garbled query gets a worse
     answer), and E[acc | cloud] is the mean fidelity over all of the user's cloud calls,
     evicted entries included (per user: another user's data must not steer this user's
     bit; all calls, not the cached ones: the survivors of eviction are a selected sample,
     and averaging them made the hit test depend on the eviction policy, see
     :mod:`.eviction`);
  2. the released decision is randomized response on b with epsilon ``rr_epsilon``
     (eps-LDP for any bit, see :mod:`.mechanism`); everything downstream (calling the
     upstream, which entry answers) depends only on the released bit, so it is
     post-processing. A released "hit" whose private bit was "miss" is still answered
     from the nearest entry: calling upstream then would reveal the true bit.
  With an empty cache the answer "miss" is a function of public facts (no call was
  ever made), so the bit costs nothing then.
  No LLM call is needed to decide. Deviation: the paper's gain estimator is not given
  in the abstract; ours uses embedding fidelity as the accuracy proxy.

``ThresholdScheduler`` (the GPTCache baseline): hit iff sim >= threshold,
deterministically. Its hit/miss pattern is NOT private; it is here only as a
reference for hit ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .mechanism import RandomizedResponse
from .store import Entry


@dataclass(frozen=True)
class Decision:
    hit: bool  # the released decision
    entry: Entry | None  # the entry that answers on a hit
    similarity: float
    gain: float  # estimated accuracy gain of a cloud call (nan when the cache is empty)
    epsilon: float  # privacy cost of releasing this decision


class LDPScheduler:
    name = "ldp"

    def __init__(self, rr_epsilon: float = 3.0, sim_threshold: float = 0.8, gain_threshold: float = 0.1):
        self.rr = RandomizedResponse(rr_epsilon)
        self.sim_threshold = float(sim_threshold)
        self.gain_threshold = float(gain_threshold)

    @property
    def worst_case_epsilon(self) -> float:
        return self.rr.epsilon

    def private_bit(self, entry: Entry | None, sim: float, cloud_accuracy: float) -> tuple[bool, float]:
        if entry is None:
            return False, float("nan")
        gain = cloud_accuracy - entry.accuracy * max(sim, 0.0)
        return bool(sim >= self.sim_threshold and gain <= self.gain_threshold), gain

    def decide(self, entry: Entry | None, sim: float, rng: np.random.Generator,
               cloud_accuracy: float = 1.0) -> Decision:
        if entry is None:
            return Decision(False, None, sim, float("nan"), 0.0)
        bit, gain = self.private_bit(entry, sim, cloud_accuracy)
        released = self.rr.release(bit, rng)
        return Decision(released, entry if released else None, sim, gain, self.rr.epsilon)


class ThresholdScheduler:
    """GPTCache-style similarity threshold (not private; baseline only)."""

    name = "threshold"
    worst_case_epsilon = 0.0

    def __init__(self, sim_threshold: float = 0.8):
        self.sim_threshold = float(sim_threshold)

    def decide(self, entry: Entry | None, sim: float, rng: np.random.Generator,
               cloud_accuracy: float = 1.0) -> Decision:
        hit = entry is not None and sim >= self.sim_threshold
        return Decision(hit, entry if hit else None, sim, float("nan"), 0.0)
