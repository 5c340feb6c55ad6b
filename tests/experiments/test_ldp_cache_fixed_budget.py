"""The fixed-total-budget experiment: its arms account honestly, the curve has intervals, pooling weighs
workloads by their queries, and the bench's section runs end to end on a stub cloud."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.experiments.ldp_cache.fixed_budget import fixed_budget_curve, pooled_at, run_fixed_budget
from llmkit.experiments.ldp_cache.runs import MemoEmbedder
from llmkit.experiments.ldp_cache.workload import build_zipf
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.ldp_cache.sentence import CandidateMechanism

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
