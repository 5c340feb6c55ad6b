"""Fixed total budget: the allocation rule never overspends and gives a hitting cache more per call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.serving.ldp_cache.budget import BudgetPlan


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
