"""Statistics behind bench/vspo.py: pooled rates with Wilson intervals over seeds, censored first steps."""

from __future__ import annotations

import pytest

from llmkit.train.vspo.compare import first_steps, pooled, summarize, wilson


def _run(rate, acc, n=20, first=None):
    return {"after": {"n": n, "behavior_rate": rate, "accuracy": acc, "mean_words": 30.0},
            "first_step_at_target": first}


def test_wilson_matches_the_textbook_interval():
    lo, hi = wilson(5, 20)
    assert lo == pytest.approx(0.1119, abs=1e-3) and hi == pytest.approx(0.4691, abs=1e-3)
    lo, hi = wilson(0, 24)
    assert lo == 0.0 and 0.1 < hi < 0.16  # a zero count still has a real upper bound
    with pytest.raises(ValueError):
        wilson(3, 0)
    with pytest.raises(ValueError):
        wilson(5, 4)


def test_pooled_counts_problems_over_seeds():
    p = pooled([_run(0.5, 0.1)["after"], _run(0.25, 0.2)["after"]], "behavior_rate")
    assert p["k"] == 15 and p["n"] == 40 and p["rate"] == pytest.approx(0.375)
    assert p["per_seed"] == [0.5, 0.25] and p["seed_sd"] == pytest.approx(0.1767767)
    assert p["ci95"][0] < 0.375 < p["ci95"][1]


def test_first_steps_keep_censored_seeds_censored():
    fs = first_steps([_run(0.5, 0, first=4), _run(0.5, 0, first=None), _run(0.5, 0, first=8)], max_steps=16)
    assert fs["reached"] == 2 and fs["per_seed"] == [4, None, 8] and fs["km_median"] == pytest.approx(8.0)
    fs = first_steps([_run(0.1, 0), _run(0.1, 0, first=2), _run(0.1, 0)], max_steps=16)
    assert fs["km_median"] is None and fs["mean_reached"] == 2  # 1 of 3: the median is not reached


def test_summarize_skips_methods_without_evaluations():
    s = summarize({"vspo": [_run(0.5, 0.1, first=2)], "grpo": [{"steps": 2}]}, max_steps=4)
    assert set(s) == {"vspo"} and s["vspo"]["seeds"] == 1 and s["vspo"]["behavior_rate"]["seed_sd"] is None
