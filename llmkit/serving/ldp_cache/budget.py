"""A fixed total privacy budget over a stream of queries: the per-call allocation rule.

Paper: LDPCache (cache-enhanced LDP for multi-query LLM processing, NeurIPS 2026): per-query LDP "leads to linear
growth in privacy budget consumption"; the cache "reduces privacy budget consumption" and so
"improves response accuracy over baseline methods". The comparison that claim implies: a user
has a total budget B for a stream of Q queries. Without a cache each query is released at
B / Q. With a cache only cloud calls (misses) spend on the query, so each call can be released
at a larger epsilon, i.e. with less noise; hits cost the scheduler's randomized-response bit.

Allocation rule (``BudgetPlan``), fixed before each query is sent
    The epsilon of a call must be chosen before the query is released and may depend only on
    public facts: B, Q, the query's index t, what was spent so far, and the released hit/miss
    decisions (a released bit is public; the private one is not). At query t, with
    r = Q - t queries left (this one included) and R the budget left after this query's bit:

        reserve    = b * (r - 1)                   every later query's bit (worst case)
        m_hat      = (misses_released + w * m0) / (t + w)   smoothed running miss rate
        e_call     = (R - reserve) / (1 + m_hat * (r - 1))

    i.e. what is left after the future bits, spread over this call and the expected later
    calls. Without a cache (b = 0, every query a call, m0 = 1) this is exactly B / Q each time.
    Since e_call <= R - reserve and the future bits are reserved, the ledger
    (:class:`.accountant.PrivacyLedger` with budget B) can never refuse a query of the plan;
    the benchmark's runs check that it does not. Because every choice is a function of earlier
    released outputs, the basic-composition privacy filter (Rogers et al. 2016) gives
    B-LDP for the whole stream (pure DP). Misses late in a stream with more misses than
    expected get less; the rule never overspends.

    The bit's epsilon b is part of the plan; the benchmark sets it to a fixed share of B / Q with a
    cap (at small B a 3-epsilon bit would eat the whole per-query budget).

The experiment that compares a cache with per-query LDP under this plan is in
``llmkit.experiments.ldp_cache.fixed_budget``; its results are in bench/results/ldp_cache_fixed_budget.md.
"""

from __future__ import annotations

import math


class BudgetPlan:
    """Per-call query epsilon for a total budget over a planned number of queries (module docstring)."""

    def __init__(self, total: float, queries: int, bit_epsilon: float = 0.0, prior_miss_rate: float = 1.0,
                 prior_weight: float = 2.0):
        if not (total >= 0 and math.isfinite(total)):
            raise ValueError(f"total budget must be a finite number >= 0, got {total}")
        if queries < 1:
            raise ValueError(f"the plan needs at least one query, got {queries}")
        if not (bit_epsilon >= 0 and math.isfinite(bit_epsilon)):
            raise ValueError(f"bit epsilon must be a finite number >= 0, got {bit_epsilon}")
        if not 0.0 < prior_miss_rate <= 1.0:
            raise ValueError(f"prior_miss_rate must be in (0, 1], got {prior_miss_rate}")
        if bit_epsilon * queries > total:
            raise ValueError(f"the scheduler bits alone ({bit_epsilon:g} x {queries}) exceed the budget {total:g}")
        self.total, self.queries, self.bit_epsilon = float(total), int(queries), float(bit_epsilon)
        self.prior_miss_rate, self.prior_weight = float(prior_miss_rate), float(prior_weight)

    def call_epsilon(self, t: int, remaining_after_bit: float, misses_released: int) -> float:
        """What query ``t`` (0-based) may spend if it is sent; public inputs only."""
        if not 0 <= t < self.queries:
            raise ValueError(f"query {t} is outside the plan of {self.queries} queries")
        r = self.queries - t
        m_hat = (misses_released + self.prior_weight * self.prior_miss_rate) / (t + self.prior_weight)
        free = remaining_after_bit - self.bit_epsilon * (r - 1)
        return max(free, 0.0) / (1.0 + min(m_hat, 1.0) * (r - 1))

