"""bench/ldp_cache.py's workloads and simulation helpers (no model, no server)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from llmkit.serving.ldp_cache import ExponentialTokenMechanism, LDPScheduler
from llmkit.serving.ldp_cache.embedder import HashEmbedder

_spec = importlib.util.spec_from_file_location(
    "bench_ldp_cache", Path(__file__).parents[1] / "bench" / "ldp_cache.py"
)
B = importlib.util.module_from_spec(_spec)
sys.modules["bench_ldp_cache"] = B
_spec.loader.exec_module(B)

PROBLEMS = [
    {"question": f"Tom has {i} apples and buys {i + 2} more. How many apples now?", "gold": str(2 * i + 2)}
    for i in range(20)
]


def visits_of(queries):
    out = []
    for q in queries:
        if not out or out[-1][0] != q["visit"]:
            out.append((q["visit"], q["problem"], []))
        out[-1][2].append(q)
    return out


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_visits_are_runs_of_distinct_templated_variants_of_one_problem(kind):
    qs = B.build(kind, PROBLEMS, 60, seed=3)
    assert qs == B.build(kind, PROBLEMS, 60, seed=3)  # deterministic
    assert qs != B.build(kind, PROBLEMS, 60, seed=4)
    vs = visits_of(qs)
    assert len(vs) == 60
    for _, pid, group in vs:
        assert 2 <= len(group) <= 4
        assert {q["problem"] for q in group} == {pid}
        assert len({q["template"] for q in group}) == len(group)  # variants, no exact repeat in a visit
        for q in group:
            assert PROBLEMS[pid]["question"] in q["text"] and q["gold"] == PROBLEMS[pid]["gold"]


def test_zipf_popularity_follows_the_law():
    n, visits = 20, 6000
    qs = B.build_zipf(PROBLEMS, visits, seed=1)
    per_problem = Counter(pid for _, pid, _ in visits_of(qs))
    freq = sorted(per_problem.values(), reverse=True) + [0] * (n - len(per_problem))
    h = sum(1 / k for k in range(1, n + 1))
    for k in (1, 2, 5):  # the most popular problems get ~ k^-1 / H of the visits
        expect = visits / (k * h)
        assert abs(freq[k - 1] - expect) < 5 * math.sqrt(expect), (k, freq[k - 1], expect)
    assert freq[0] > 8 * freq[-1]  # skewed: a head and a long tail


def test_zipf_popular_problems_differ_between_workload_seeds():
    top = {
        Counter(pid for _, pid, _ in visits_of(B.build_zipf(PROBLEMS, 400, seed=s))).most_common(1)[0][0]
        for s in range(8)
    }
    assert len(top) > 1


def test_uniform_revisits_only_seen_problems_and_introduces_new_ones_in_order():
    vs = visits_of(B.build_uniform(PROBLEMS, 40, seed=0))
    seen = set()
    for i, (_, pid, _) in enumerate(vs):
        if pid not in seen:
            assert pid == len(seen)  # new problems come in order
            seen.add(pid)
        else:
            assert i > 0 and pid != vs[i - 1][1]  # a revisit is to another earlier problem
    assert 5 < len(seen) < 40


def test_answers_file_resumes_without_asking_again(tmp_path):
    calls = []

    def upstream(messages, **params):
        calls.append(messages)
        return f"answer {len(calls)}"

    path = tmp_path / "answers.jsonl"
    m = [{"role": "user", "content": "hi"}]
    a = B.MemoUpstream(upstream, path)
    assert a(m, max_tokens=8) == "answer 1" and a(m, max_tokens=8) == "answer 1"
    assert a(m, max_tokens=9) == "answer 2"  # params are part of the key
    b = B.MemoUpstream(upstream, path)
    assert b(m, max_tokens=8) == "answer 1" and b(m, max_tokens=9) == "answer 2"
    assert len(calls) == 2 and b.calls == 0
    assert len(path.read_text().splitlines()) == 2 and json.loads(path.read_text().splitlines()[0])["text"]


VOCAB = ["<unk>", "tom", "has", "apples", "and", "buys", "more", ".", "how", "many", "now", "?"] + [
    str(i) for i in range(45)
]


def mech():
    return ExponentialTokenMechanism.word_level(
        VOCAB, np.random.default_rng(0).normal(size=(len(VOCAB), 8)), 6.0
    )


def test_memo_mechanism_replays_exactly_the_same_draws():
    m, memo = mech(), B.MemoMechanism(mech())
    text = "tom has 3 apples and buys 5 more . how many apples now ?"
    for s in range(5):
        a = m.perturb(text, np.random.default_rng(s))
        assert memo.perturb(text, np.random.default_rng(s)) == a
        assert memo.perturb(text, np.random.default_rng(s)) == a  # from the memo
    outs = {memo.perturb(text, np.random.default_rng(s)).text for s in range(5)}
    assert len(outs) > 1  # the key is the generator state, not only the text
    assert memo.query_epsilon(text) == m.query_epsilon(text)


def test_hit_ratio_does_not_depend_on_the_response_text():
    """Why the sweep may use a stand-in upstream: same hits with real-looking and empty answers."""
    qs = B.build_zipf(PROBLEMS, 30, seed=2)
    emb = B.MemoEmbedder(HashEmbedder())
    for policy in ("multifactor", "lru"):
        kw = {"capacity": 3, "policy": policy, "seed": [0], "bit_seed": 7, "max_tokens": 4}
        with_text = B.run_cache(
            qs, mech(), emb, lambda m, **p: "The answer is 42.", scheduler=LDPScheduler(3.0, 0.8, 0.2), **kw
        )
        stub = B.run_cache(
            qs, mech(), emb, B.stub_upstream, scheduler=LDPScheduler(3.0, 0.8, 0.2), score=False, **kw
        )
        assert with_text["hit_ratio"] == stub["hit_ratio"] and 0 < stub["hit_ratio"] < 1
        assert with_text["epsilon_per_query"] == stub["epsilon_per_query"]
