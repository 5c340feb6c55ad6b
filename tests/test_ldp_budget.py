"""Fixed total budget: the allocation rule never overspends, and the experiment's arms account honestly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.serving.ldp_cache.budget import BudgetPlan, fixed_budget_curve, run_fixed_budget
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.ldp_cache.experiment import MemoEmbedder
from llmkit.serving.ldp_cache.sentence import CandidateMechanism
from llmkit.serving.ldp_cache.workload import build_zipf


def test_without_a_cache_every_query_gets_b_over_q():
    plan = BudgetPlan(12.0, 4)
    left = 12.0
    for t in range(4):
        e = plan.call_epsilon(t, left, t)
        assert e == pytest.approx(3.0)
        left -= e
    with pytest.raises(ValueError, match="outside the plan"):
        plan.call_epsilon(4, left, 4)


@settings(max_examples=80, deadline=None)
@given(q=st.integers(1, 60), per_query=st.floats(0.5, 20.0), share=st.floats(0.0, 0.9),
       hits=st.lists(st.booleans(), min_size=60, max_size=60))
def test_the_plan_never_spends_more_than_the_budget_whatever_the_hits(q, per_query, share, hits):
    total, bit = per_query * q, share * per_query
    plan = BudgetPlan(total, q, bit)
    left, misses = total, 0
    for t in range(q):
        left -= bit  # the released bit (the worst case: charged on every query)
        assert left >= -1e-9
        if t == 0 or not hits[t]:  # the first query always misses
            e = plan.call_epsilon(t, left, misses)
            assert e >= 0
            left -= e
            misses += 1
        assert left >= -1e-9


def test_a_cache_that_hits_gives_its_calls_more_than_b_over_q():
    plan = BudgetPlan(40.0, 10, bit_epsilon=1.0)
    left, misses, calls = 40.0, 0, []
    for t in range(10):
        left -= 1.0
        if t % 2 == 0:  # every other query is a hit
            e = plan.call_epsilon(t, left, misses)
            calls.append(e)
            left -= e
            misses += 1
    # the first call gets (B - all bits) / Q; as the released misses show a miss rate of 1/2, calls get more
    assert calls[0] == pytest.approx(3.0) and calls == sorted(calls) and np.mean(calls) > 4.0
    assert 0 <= left < 40.0 / 8  # within budget, and most of it used


def test_bad_plans_are_refused_by_name():
    with pytest.raises(ValueError, match="bits alone"):
        BudgetPlan(5.0, 10, bit_epsilon=1.0)
    with pytest.raises(ValueError, match="total budget"):
        BudgetPlan(float("nan"), 10)
    with pytest.raises(ValueError, match="at least one query"):
        BudgetPlan(1.0, 0)


PROBLEMS = [{"question": f"Tom has {i} red apples and {i + 2} green apples in his big basket. "
             f"What is {i} plus {i + 2}?", "gold": str(2 * i + 2)} for i in range(8)]
BANK = [p["question"] for p in PROBLEMS] + [f"What is the colour of house number {i} on Elm street?" for i in range(12)]


def oracle(messages, **params):
    """A cloud that answers every bank question right (the plain question's sum)."""
    text = messages[-1]["content"]
    for p in PROBLEMS:
        if p["question"] == text:
            return f"The answer is {p['gold']}."
    return "I do not know, maybe 0."


def test_fixed_budget_arms_stay_within_budget_and_the_cache_spends_more_per_call():
    emb = MemoEmbedder(HashEmbedder())
    mech = CandidateMechanism(BANK, emb, 1.0)
    qs = build_zipf(PROBLEMS, 12, seed=1)
    assert all(x["text"] != PROBLEMS[x["problem"]]["question"] or x["template"] == 0 for x in qs)
    kw = {"mechanism": mech, "embedder": emb, "upstream": oracle, "per_query": 3.0, "capacity": 4,
          "seed": [0], "bit_seed": 1, "max_tokens": 8}
    res = {arm: run_fixed_budget(qs, arm, **kw) for arm in ("no_cache", "ldpcache", "lru", "gptcache")}
    total = 3.0 * len(qs)
    for arm, r in res.items():
        assert r["spent"] <= total + 1e-9 and r["total"] == pytest.approx(total)
        assert all(t in BANK for t in r["sent_texts"])  # only public candidates ever leave the device
    nc = res["no_cache"]
    assert nc["calls"] == len(qs) and nc["epsilon_per_call"] == pytest.approx(3.0)
    assert nc["spent"] == pytest.approx(total, abs=1e-4)
    for arm in ("ldpcache", "lru", "gptcache"):
        assert 0 < res[arm]["hit_ratio"] < 1 and res[arm]["epsilon_per_call"] > 3.0
    assert res["ldpcache"]["bit_epsilon"] == pytest.approx(0.75) and res["gptcache"]["bit_epsilon"] == 0


def test_the_curve_reports_every_arm_with_intervals_and_accuracy_rises_with_budget():
    emb = MemoEmbedder(HashEmbedder())
    mech = CandidateMechanism(BANK, emb, 1.0)
    qs = build_zipf(PROBLEMS, 10, seed=2)
    curve = fixed_budget_curve(qs, [0.5, 12.0], repeats=3, seed=[0], mechanism=mech, embedder=emb,
                               upstream=oracle, capacity=4, max_tokens=8)
    lo, hi = curve["0.5"], curve["12.0"]
    for cell in (lo, hi):
        assert set(cell) == {"no_cache", "ldpcache", "lru", "gptcache"}
        for arm, m in cell.items():
            a, (c0, c1) = m["accuracy"], m["accuracy_ci95"]
            assert 0 <= c0 <= a + 1e-9 and a - 1e-9 <= c1 <= 1
            assert arm == "no_cache" or "diff_vs_no_cache_ci95" in m
    assert hi["no_cache"]["accuracy"] > 0.9 and lo["no_cache"]["accuracy"] < 0.5  # eps 12: the right question
    with pytest.raises(ValueError, match="unknown arm"):
        run_fixed_budget(qs, "fifo", mechanism=mech, embedder=emb, upstream=oracle, per_query=1.0,
                         capacity=2, seed=[0], bit_seed=0, max_tokens=8)
    assert np.isfinite(lo["ldpcache"]["diff_vs_no_cache"])


def test_pooled_figures_weight_workloads_by_their_queries():
    from llmkit.serving.ldp_cache.budget import pooled_at

    streams = {"a": [{"problem": p} for p in (0, 0, 1, 1)], "b": [{"problem": p} for p in (0, 1, 2, 3)]}

    def cell(cpp, calls, eps):
        return {"correct_per_problem": cpp, "calls": calls, "epsilon_per_call": eps, "hit_ratio": 1 - calls / 4}

    curves = {"a": {"4": {"no_cache": cell({0: 2}, 4, 4.0), "ldpcache": cell({0: 2, 1: 2}, 2, 8.0)}},
              "b": {"4": {"no_cache": cell({}, 4, 4.0), "ldpcache": cell({3: 1}, 2, 6.0)}}}
    out = pooled_at(curves, streams, 4)
    assert out["no_cache"]["accuracy"] == pytest.approx(2 / 8) and out["ldpcache"]["accuracy"] == pytest.approx(5 / 8)
    assert out["ldpcache"]["diff_vs_no_cache"] == pytest.approx(3 / 8)
    assert out["ldpcache"]["epsilon_per_call"] == pytest.approx(7.0) and out["ldpcache"]["hit_ratio"] == 0.5
    lo, hi = out["ldpcache"]["diff_vs_no_cache_ci95"]
    assert lo <= 3 / 8 <= hi
