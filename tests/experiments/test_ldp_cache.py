"""The LDPCache bench's library code: workloads (workload.py) and runs, memos and statistics (runs.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from llmkit.experiments.ldp_cache import runs as X
from llmkit.experiments.ldp_cache import workload as W
from llmkit.serving.ldp_cache import ExponentialTokenMechanism, LDPScheduler
from llmkit.serving.ldp_cache.embedder import HashEmbedder

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
    qs = W.build(kind, PROBLEMS, 60, seed=3)
    assert qs == W.build(kind, PROBLEMS, 60, seed=3)  # deterministic
    assert qs != W.build(kind, PROBLEMS, 60, seed=4)
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
    qs = W.build_zipf(PROBLEMS, visits, seed=1)
    per_problem = Counter(pid for _, pid, _ in visits_of(qs))
    freq = sorted(per_problem.values(), reverse=True) + [0] * (n - len(per_problem))
    h = sum(1 / k for k in range(1, n + 1))
    for k in (1, 2, 5):  # the most popular problems get ~ k^-1 / H of the visits
        expect = visits / (k * h)
        assert abs(freq[k - 1] - expect) < 5 * math.sqrt(expect), (k, freq[k - 1], expect)
    assert freq[0] > 8 * freq[-1]  # skewed: a head and a long tail


def test_zipf_popular_problems_differ_between_workload_seeds():
    top = {
        Counter(pid for _, pid, _ in visits_of(W.build_zipf(PROBLEMS, 400, seed=s))).most_common(1)[0][0]
        for s in range(8)
    }
    assert len(top) > 1


def test_uniform_revisits_only_seen_problems_and_introduces_new_ones_in_order():
    vs = visits_of(W.build_uniform(PROBLEMS, 40, seed=0))
    seen = set()
    for i, (_, pid, _) in enumerate(vs):
        if pid not in seen:
            assert pid == len(seen)  # new problems come in order
            seen.add(pid)
        else:
            assert i > 0 and pid != vs[i - 1][1]  # a revisit is to another earlier problem
    assert 5 < len(seen) < 40


@pytest.mark.parametrize("name", ["answers.jsonl", "answers.jsonl.gz"])
def test_answers_file_resumes_without_asking_again(tmp_path, name):
    calls = []

    def upstream(messages, **params):
        calls.append(messages)
        return f"answer {len(calls)}"

    path = tmp_path / name
    m = [{"role": "user", "content": "hi"}]
    a = X.MemoUpstream(upstream, path)
    assert a(m, max_tokens=8) == "answer 1" and a(m, max_tokens=8) == "answer 1"
    assert a(m, max_tokens=9) == "answer 2"  # params are part of the key
    b = X.MemoUpstream(upstream, path)
    assert b(m, max_tokens=8) == "answer 1" and b(m, max_tokens=9) == "answer 2"
    assert len(calls) == 2 and b.calls == 0
    with X.open_text(path, "rt") as f:  # two appends, each readable (gzip: two members)
        lines = f.read().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["text"] == "answer 1"


VOCAB = ["<unk>", "tom", "has", "apples", "and", "buys", "more", ".", "how", "many", "now", "?"] + [
    str(i) for i in range(45)
]


def mech():
    return ExponentialTokenMechanism.word_level(
        VOCAB, np.random.default_rng(0).normal(size=(len(VOCAB), 8)), 6.0
    )


def test_memo_mechanism_replays_exactly_the_same_draws():
    m, memo = mech(), X.MemoMechanism(mech())
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
    qs = W.build_zipf(PROBLEMS, 30, seed=2)
    emb = X.MemoEmbedder(HashEmbedder())
    for policy in ("multifactor", "lru"):
        kw = {"capacity": 3, "policy": policy, "seed": [0], "bit_seed": 7, "max_tokens": 4}
        with_text = X.run_cache(
            qs, mech(), emb, lambda m, **p: "The answer is 42.", scheduler=LDPScheduler(3.0, 0.8, 0.2), **kw
        )
        stub = X.run_cache(
            qs, mech(), emb, X.stub_upstream, scheduler=LDPScheduler(3.0, 0.8, 0.2), score=False, **kw
        )
        assert with_text["hit_ratio"] == stub["hit_ratio"] and 0 < stub["hit_ratio"] < 1
        assert with_text["epsilon_per_query"] == stub["epsilon_per_query"]


# --- the one-step arithmetic workloads (uniform_arith / zipf_arith) ---


def test_arith_question_takes_the_first_fitting_annotation_and_keeps_the_context():
    q = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    a = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    p = W.arith_question(q, a)
    assert p == {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. What is 48 divided by 2?",
        "gold": "24",
        "annotation": "48/2=24",
        "source": q,
    }


@pytest.mark.parametrize(
    ("answer", "annotation", "phrase"),
    [
        ("x <<12/60=0.2>>0.2 y <<0.2*50=10>>10 z <<7*8=56>>56", "7*8=56", "7 times 8"),  # decimals skipped
        ("<<100-50-30-15=5>>5 then <<9-4=5>>5", "9-4=5", "9 minus 4"),  # multi-step skipped
        ("<<120-36=84>>84 then <<36+4=40>>40", "36+4=40", "36 plus 4"),  # > 100 skipped
        ("<<3*4=13>>13 then <<3*4=12>>12", "3*4=12", "3 times 4"),  # a wrong annotation is skipped
        ("<<7/2=3>>3 then <<8/2=4>>4", "8/2=4", "8 divided by 2"),  # inexact division skipped
    ],
)
def test_arith_question_checks_the_annotation(answer, annotation, phrase):
    p = W.arith_question("Tom has some apples. How many now?", answer)
    assert p["annotation"] == annotation and p["question"] == f"Tom has some apples. What is {phrase}?"
    a, rest = annotation.split("=")[0], annotation.split("=")[1]
    assert p["gold"] == rest and int(rest) == eval(a.replace("/", "//"))


def test_arith_question_skips_problems_without_a_usable_annotation_or_context():
    assert W.arith_question("Tom has apples. How many?", "<<120*2=240>>240 <<1.5*2=3>>3") is None
    assert W.arith_question("How many apples does Tom have?", "<<2+3=5>>5") is None  # one sentence


def test_arith_problem_set_from_gsm8k_train_has_correct_gold_answers(shared_data):
    DATA = shared_data / "gsm8k" / "train.jsonl"
    ps = W.load_arith_problems(DATA, 40, seed=0)
    assert len(ps) == 40 and ps == W.load_arith_problems(DATA, 40, seed=0)
    assert len({p["question"] for p in ps}) == 40
    for p in ps:
        m = W._ANNOTATION.fullmatch(f"<<{p['annotation']}>>")
        x, op, y, z = int(m[1]), m[2], int(m[3]), int(m[4])
        assert p["gold"] == str(z) and max(x, y, z) <= W.ARITH_MAX
        assert {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op] == z
        assert p["question"].endswith(f"What is {x} {W.ARITH_WORDS[op]} {y}?")
        context = p["question"].rsplit(" What is ", 1)[0]
        words = p["source"].split()  # the context is the source minus its last sentence (spaces normalized)
        assert (
            " ".join(words).startswith(context) and len(context) < len(" ".join(words)) and len(words) <= 45
        )


@pytest.mark.parametrize("kind", ["uniform_arith", "zipf_arith"])
def test_arith_workloads_have_the_same_visit_structure(kind):
    base = kind.removesuffix("_arith")
    assert W.build(kind, PROBLEMS, 30, seed=5) == W.build(base, PROBLEMS, 30, seed=5)
    ps = [{"question": f"Tom has {i} apples. What is {i} plus 2?", "gold": str(i + 2)} for i in range(12)]
    for _, pid, group in visits_of(W.build(kind, ps, 30, seed=5)):
        assert 2 <= len(group) <= 4 and len({q["template"] for q in group}) == len(group)
        assert all(ps[pid]["question"] in q["text"] and q["gold"] == str(pid + 2) for q in group)


def test_run_cache_counts_hit_accuracy_against_the_no_cache_answer():
    """Accuracy can only differ on hits; the bench reports them with the no-cache arm's answer."""
    qs = W.build_zipf(PROBLEMS, 30, seed=2)
    for x in qs:
        x["no_cache_correct"] = True
    emb = X.MemoEmbedder(HashEmbedder())
    r = X.run_cache(
        qs,
        mech(),
        emb,
        lambda m, **p: "The answer is 1.",
        scheduler=LDPScheduler(3.0, 0.8, 0.2),
        capacity=3,
        policy="lru",
        seed=[0],
        bit_seed=7,
        max_tokens=4,
    )
    assert 0 < r["hits"] < len(qs) and r["hits"] == round(r["hit_ratio"] * len(qs))
    assert r["hits_correct"] == 0 and r["hits_correct_no_cache"] == r["hits"]
    assert r["max_hits_per_wrong_answer"] == r["hits"]  # one answer text, wrong everywhere


def test_problem_bootstrap_interval():
    queries = {p: 10 for p in range(20)}
    same = X.problem_bootstrap(queries, {p: 5 for p in range(20)}, {p: 5 for p in range(20)})
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["share_below_0"] == 0
    better = X.problem_bootstrap(queries, {p: 6 for p in range(20)}, {p: 5 for p in range(20)})
    assert better["diff"] == pytest.approx(0.1) and better["ci95"][0] == pytest.approx(0.1)
    # one problem carries the whole loss: the interval must reach 0 (it is left out of some resamples)
    one = X.problem_bootstrap(queries, {0: 0}, {0: 10})
    assert one["diff"] == pytest.approx(-0.05) and one["ci95"][0] < -0.05 < one["ci95"][1] == 0
    assert 0.5 < one["share_below_0"] < 1


def test_mean_runs_averages_correct_answers_per_problem():
    runs = [
        {"hit_ratio": 0.5, "accuracy": 0.1, "correct_per_problem": {0: 2, 1: 1}},
        {"hit_ratio": 0.7, "accuracy": 0.3, "correct_per_problem": {0: 4}},
    ]
    m = X.mean_runs(runs)
    assert m["correct_per_problem"] == {0: 3.0, 1: 0.5} and m["accuracy"] == pytest.approx(0.2)


def test_pooled_bootstrap_keeps_workloads_problems_apart():
    # both workloads number their problems 0..9; problem 0 loses in one and gains in the other
    queries = {p: 10 for p in range(10)}
    pooled = X.pooled_bootstrap(
        {"u": (queries, {0: 0}, {0: 10}), "z": (queries, {0: 10}, {0: 0})}, draws=2000
    )
    assert pooled["problems"] == 20 and pooled["diff"] == 0
    assert pooled["ci95"][0] < 0 < pooled["ci95"][1]  # merged by id they would cancel to [0, 0]
    alone = X.problem_bootstrap(queries, {0: 0}, {0: 10}, draws=2000)
    assert alone["diff"] == pytest.approx(-0.1)


def test_a_malformed_gsm8k_file_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "answer": "x #### 3"}) + "\n" + json.dumps({"question": "Q"}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:2: not a GSM8K record"):
        W.load_problems(bad, 5, seed=0)
    with pytest.raises(ValueError, match=r"train.jsonl:2: not a GSM8K record"):
        W.load_arith_problems(bad, 5, seed=0)


def test_evaluate_workload_reuses_the_no_cache_answers_and_scores_every_arm():
    from llmkit.serving.ldp_cache import PerQueryLDP, PrivacyLedger

    qs = W.build_zipf(PROBLEMS, 20, seed=4)
    calls = []

    def upstream(messages, **params):
        calls.append(messages)
        return "so it is 42" if "apples" in messages[-1]["content"] else "it is 0"

    memo = X.MemoUpstream(upstream)
    emb = X.MemoEmbedder(HashEmbedder())
    m = X.MemoMechanism(mech())
    base = PerQueryLDP(memo, PrivacyLedger(":memory:", 1e18), m)
    answers = [base.ask(x["text"], seed=[0, 1, i], max_tokens=4, temperature=0) for i, x in enumerate(qs)]
    plain = {p: f"the answer is {PROBLEMS[p]['gold']}" for p in {x["problem"] for x in qs}}
    n_calls = len(calls)
    r = X.evaluate_workload(qs, PROBLEMS, answers, plain, mechanism=m, embedder=emb, upstream=memo,
                            sched=lambda: LDPScheduler(3.0, 0.8, 0.2), capacity=3, repeats=2, seed=0, wseed=1,
                            max_tokens=4, sim_threshold=0.8)
    assert len(calls) == n_calls  # every cache miss replayed a no-cache call (common random numbers)
    assert set(r["arms"]) == {"no_cache", "ldpcache_multifactor", "ldpcache_lru", "ldpcache_unbounded",
                              "gptcache_threshold"}
    assert r["accuracy_plain_queries"] == 1.0 and r["problems"] == len(plain)
    for name, arm in r["arms"].items():
        assert 0 <= arm["accuracy"] <= 1 and (name == "no_cache") == (arm["hit_ratio"] == 0)
    assert r["arms"]["no_cache"]["epsilon_per_query"] > r["arms"]["ldpcache_multifactor"]["epsilon_per_query"]
    assert all("ref" in x and "no_cache_correct" in x for x in qs)
    lo, hi = r["accuracy_diff_vs_no_cache"]["ldpcache_lru"]["ci95"]
    assert lo <= r["accuracy_diff_vs_no_cache"]["ldpcache_lru"]["diff"] <= hi
    assert sum(v["queries"] for v in r["per_problem"].values()) == len(qs)
