"""The sentence-level candidate mechanism: exact and empirical privacy loss, utility, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmkit.experiments.ldp_cache.runs import MemoEmbedder
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.ldp_cache.sentence import CandidateMechanism

BANK = [f"tom has {i} apples and ann has {i + 3} pears how many fruit" for i in range(10)] + [
    "what is the capital of france", "how tall is the eiffel tower", "who wrote hamlet",
    "what does a kilo of rice cost", "when does the train to paris leave",
]


def mech(eps=4.0, top_m=1):
    return CandidateMechanism(BANK, MemoEmbedder(HashEmbedder()), eps, top_m)


def test_the_nearest_candidate_is_the_query_itself_or_its_paraphrase():
    m = mech()
    assert BANK[m.nearest("Who wrote Hamlet?")[0]] == "who wrote hamlet"
    assert BANK[m.nearest("please tell me: tom has 7 apples and ann has 10 pears, how many fruit?")[0]] == BANK[7]


@pytest.mark.parametrize("eps", [0.5, 2.0, 6.0])
@pytest.mark.parametrize("top_m", [1, 3])
def test_exact_privacy_loss_is_eps_for_any_two_queries(eps, top_m):
    """Every pair of queries is a neighbour pair (any length): the log-ratio never exceeds eps, and reaches it."""
    m = mech(eps, top_m)
    queries = ["who wrote hamlet", "tom has 2 apples and ann has 5 pears how many fruit", "x", "a " * 80]
    worst = 0.0
    for a in queries:
        for b in queries:
            loss = np.max(np.abs(np.log(m.probabilities(a)) - np.log(m.probabilities(b))))
            assert loss <= eps + 1e-9
            worst = max(worst, loss)
    assert worst == pytest.approx(eps)  # tight: different nearest sets give exactly e^eps
    p = m.probabilities("who wrote hamlet")
    assert p.sum() == pytest.approx(1.0)
    assert p.max() == pytest.approx(math.exp(eps) / (top_m * math.exp(eps) + len(BANK) - top_m))


def test_empirical_distinguishability_of_neighbouring_queries_is_within_eps():
    """Sample the mechanism (its rng path) on two neighbours; the best likelihood-ratio test stays within eps."""
    eps, n = 1.5, 20_000
    m = mech(eps)
    x, x2 = "who wrote hamlet", "what is the capital of france"
    rng = np.random.default_rng(0)
    ka = np.bincount([BANK.index(m.perturb(x, rng).text) for _ in range(n)], minlength=len(BANK)) / n
    kb = np.bincount([BANK.index(m.perturb(x2, rng).text) for _ in range(n)], minlength=len(BANK)) / n
    assert np.abs(ka - m.probabilities(x)).sum() < 0.05  # the sampler draws from the stated law
    ok = (ka * n >= 300) & (kb * n >= 300)
    emp = np.max(np.abs(np.log(ka[ok]) - np.log(kb[ok])))
    assert eps - 0.3 <= emp <= eps + 0.3
    # the attacker's best test "output == nearest(x)": true-positive / false-positive ratio <= e^eps
    i = BANK.index("who wrote hamlet")
    assert ka[i] / kb[i] <= math.exp(eps) * 1.15


def test_utility_rises_with_epsilon_and_the_charge_is_the_epsilon():
    rng = np.random.default_rng(1)
    rates = []
    m = mech(4.0)
    for eps in (0.0, 2.0, 8.0):
        outs = [m.perturb("who wrote hamlet", rng, epsilon=eps) for _ in range(400)]
        assert all(o.epsilon == eps for o in outs)
        rates.append(np.mean([o.text == "who wrote hamlet" for o in outs]))
    assert rates[0] < 0.15 and rates[1] > rates[0] + 0.2 and rates[2] > 0.95
    assert mech(4.0).query_epsilon("anything at all, of any length") == 4.0


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="at least 2"):
        CandidateMechanism(["only one"], HashEmbedder(), 1.0)
    with pytest.raises(ValueError, match="duplicate"):
        CandidateMechanism(["a", "a"], HashEmbedder(), 1.0)
    with pytest.raises(ValueError, match="top_m"):
        CandidateMechanism(["a", "b"], HashEmbedder(), 1.0, top_m=2)
    with pytest.raises(ValueError, match="epsilon"):
        CandidateMechanism(["a", "b"], HashEmbedder(), -1.0)
    with pytest.raises(ValueError, match="epsilon"):
        mech().perturb("x", np.random.default_rng(0), epsilon=float("nan"))
