"""A fixed total privacy budget over a stream of queries: the allocation rule and the experiment.

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
    the runs below check that it does not. Because every choice is a function of earlier
    released outputs, the basic-composition privacy filter (Rogers et al. 2016) gives
    B-LDP for the whole stream (pure DP). Misses late in a stream with more misses than
    expected get less; the rule never overspends.

    The bit's epsilon b is part of the plan: ``bit_share`` x B / Q, at most ``bit_cap``
    (a fixed share of the per-query budget: at small B a 3-epsilon bit would eat it all).

Arms (:func:`run_fixed_budget`): ``no_cache`` (every query released at B / Q),
``ldpcache`` (LDPCache's scheduler, multi-factor eviction), ``lru`` (LDPCache's scheduler,
LRU eviction), ``gptcache`` (a similarity threshold; its decision is NOT private and is
charged nothing, so it is a reference, not a private method).
"""

from __future__ import annotations

import math
from collections import Counter

from .workload import correct

ARMS = ("no_cache", "ldpcache", "lru", "gptcache")


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


def run_fixed_budget(queries: list[dict], arm: str, *, mechanism, embedder, upstream, per_query: float,
                     capacity: int, seed, bit_seed, max_tokens: int, bit_share: float = 0.25,
                     bit_cap: float = 3.0, sim_threshold: float = 0.8, gain_threshold: float = 0.1) -> dict:
    """One pass of ``arm`` over the stream with total budget ``per_query * len(queries)``.

    Query i's perturbation uses the seed ``[*seed, i]`` in every arm (common random numbers).
    Returns per-query correctness, hits, the epsilon of each cloud call and the total spent.
    """
    from .accountant import PrivacyLedger
    from .client import LDPCache, PerQueryLDP
    from .eviction import make_policy
    from .scheduler import LDPScheduler, ThresholdScheduler
    from .store import CacheStore

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    q = len(queries)
    total = per_query * q
    ledger = PrivacyLedger(":memory:", total)
    bit = 0.0 if arm in ("no_cache", "gptcache") else min(bit_share * per_query, bit_cap)
    plan = BudgetPlan(total, q, bit)
    if arm == "no_cache":
        client = PerQueryLDP(upstream, ledger, mechanism)
    else:
        sched = (ThresholdScheduler(sim_threshold) if arm == "gptcache"
                 else LDPScheduler(bit, sim_threshold, gain_threshold) if bit > 0 else None)
        if sched is None:
            raise ValueError("a private cache arm needs a positive bit epsilon (bit_share x per_query)")
        store = CacheStore(capacity=capacity, policy=make_policy("lru" if arm == "lru" else "multifactor"))
        client = LDPCache(upstream, ledger, store, mechanism, embedder, sched)
    rows, misses = [], 0
    for i, x in enumerate(queries):
        # the ledger rounds charges up to micro-epsilons: keep 2 of them spare per query
        remaining = ledger.remaining("default") - 2e-6
        if arm == "no_cache":
            e = plan.call_epsilon(i, remaining, i)
            a = client.ask(x["text"], seed=[*seed, i], epsilon=e, max_tokens=max_tokens, temperature=0)
        else:
            # the bit is reserved even when the cache is empty (then it is refunded): public either way
            e = plan.call_epsilon(i, remaining - bit, misses)
            a = client.ask(x["text"], seed=[*seed, i], bit_seed=[bit_seed, i], epsilon=e,
                           max_tokens=max_tokens, temperature=0)
        misses += not a.cache_hit
        rows.append({"hit": a.cache_hit, "call_epsilon": None if a.cache_hit else e,
                     "correct": correct(a.text, x["gold"]), "sent": None if a.cache_hit else a.sent_messages})
    calls = [r["call_epsilon"] for r in rows if r["call_epsilon"] is not None]
    return {
        "accuracy": sum(r["correct"] for r in rows) / q,
        "hit_ratio": sum(r["hit"] for r in rows) / q,
        "calls": len(calls),
        "epsilon_per_call": sum(calls) / len(calls) if calls else 0.0,
        "epsilon_per_call_min": min(calls, default=0.0),
        "spent": ledger.spent("default"),
        "total": total,
        "bit_epsilon": bit,
        "correct_per_problem": dict(Counter(x["problem"] for x, r in zip(queries, rows) if r["correct"])),
        "sent_texts": [r["sent"][0]["content"] for r in rows if r["sent"]],
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    """Average of :func:`run_fixed_budget` results over seeds (correct answers per problem averaged)."""
    keys = ("accuracy", "hit_ratio", "calls", "epsilon_per_call", "spent")
    out = {k: sum(r[k] for r in runs) / len(runs) for k in keys}
    out["epsilon_per_call_min"] = min(r["epsilon_per_call_min"] for r in runs)
    out["spent_max"] = max(r["spent"] for r in runs)
    out["total"], out["bit_epsilon"] = runs[0]["total"], runs[0]["bit_epsilon"]
    pids = {p for r in runs for p in r["correct_per_problem"]}
    out["correct_per_problem"] = {p: sum(r["correct_per_problem"].get(p, 0) for r in runs) / len(runs)
                                  for p in pids}
    out["accuracy_runs"] = [round(r["accuracy"], 4) for r in runs]
    return out


def fixed_budget_curve(queries: list[dict], per_query_budgets, *, repeats: int, seed, arms=ARMS,
                       progress=None, **kw) -> dict:
    """Every arm at every per-query budget B/Q, averaged over ``repeats`` seeds, with intervals.

    Intervals: 95% bootstrap over problems (:func:`.experiment.problem_bootstrap`) of each arm's
    accuracy and of its difference from the no-cache arm at the same budget.
    """
    from .experiment import problem_bootstrap

    per_problem = dict(Counter(x["problem"] for x in queries))
    out = {}
    for b in per_query_budgets:
        cell = {}
        for arm in arms:
            runs = [run_fixed_budget(queries, arm, per_query=b, seed=[*seed, r], bit_seed=1000 + r, **kw)
                    for r in range(repeats)]
            m = mean_over_seeds(runs)
            acc = problem_bootstrap(per_problem, m["correct_per_problem"], {})
            m["accuracy_ci95"] = acc["ci95"]
            cell[arm] = m
            if progress is not None:
                progress(b, arm, m)
        for arm in arms:
            if arm != "no_cache" and "no_cache" in cell:
                d = problem_bootstrap(per_problem, cell[arm]["correct_per_problem"],
                                      cell["no_cache"]["correct_per_problem"])
                cell[arm]["diff_vs_no_cache"] = d["diff"]
                cell[arm]["diff_vs_no_cache_ci95"] = d["ci95"]
        out[str(b)] = cell
    return out


def pooled_at(curves: dict[str, dict], streams: dict[str, list[dict]], budget) -> dict:
    """Every arm's accuracy at one per-query budget pooled over workloads, with problem-bootstrap intervals.

    ``curves[k]`` is :func:`fixed_budget_curve`'s result for workload k over ``streams[k]``; a problem
    is a unit within its workload. Also the pooled difference of each arm from the no-cache arm.
    """
    from .experiment import pooled_bootstrap

    key = str(budget)
    arms = list(next(iter(curves.values()))[key])
    out = {}
    for arm in arms:
        per = {k: (Counter(x["problem"] for x in streams[k]), curves[k][key][arm]["correct_per_problem"], {})
               for k in curves}
        acc = pooled_bootstrap(per)
        n = sum(len(streams[k]) for k in curves)
        calls = sum(curves[k][key][arm]["calls"] for k in curves)
        out[arm] = {
            "accuracy": acc["diff"], "accuracy_ci95": acc["ci95"],
            "epsilon_per_call": sum(curves[k][key][arm]["epsilon_per_call"] * curves[k][key][arm]["calls"]
                                    for k in curves) / calls if calls else 0.0,
            "hit_ratio": sum(curves[k][key][arm]["hit_ratio"] * len(streams[k]) for k in curves) / n,
        }
        if arm != "no_cache" and "no_cache" in arms:
            d = pooled_bootstrap({k: (Counter(x["problem"] for x in streams[k]),
                                      curves[k][key][arm]["correct_per_problem"],
                                      curves[k][key]["no_cache"]["correct_per_problem"]) for k in curves})
            out[arm]["diff_vs_no_cache"], out[arm]["diff_vs_no_cache_ci95"] = d["diff"], d["ci95"]
    return out
