"""LDPCache perturbation: the exponential mechanism and randomized response stay within epsilon."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.serving.ldp_cache.mechanism import ExponentialTokenMechanism, RandomizedResponse


def _mech(n: int, dim: int, eps: float, seed: int) -> ExponentialTokenMechanism:
    emb = np.random.default_rng(seed).normal(size=(n, dim))
    vocab = [f"w{i}" for i in range(n)]
    return ExponentialTokenMechanism.word_level(vocab, emb, eps)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), dim=st.integers(1, 8), eps=st.floats(0.05, 60.0), seed=st.integers(0, 10_000),
       data=st.data())
def test_exact_privacy_loss_is_within_eps_times_distance(n, dim, eps, seed, data):
    m = _mech(n, dim, eps, seed)
    x = data.draw(st.integers(0, n - 1))
    x2 = data.draw(st.integers(0, n - 1))
    logp = m.log_probabilities([x, x2])
    loss = np.max(np.abs(logp[0] - logp[1]))
    d = m.distances([x])[0, x2]
    assert 0.0 <= d <= 1.0
    assert loss <= eps * d + 1e-9  # metric-DP, the tighter statement
    assert loss <= eps + 1e-9  # hence pure eps-LDP per token


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(0.5, 4.0), data=st.data())
def test_empirical_privacy_loss_on_sampled_neighbours(seed, eps, data):
    """Sample the mechanism itself (Gumbel-max path) and bound the empirical log-ratio."""
    n = 6
    m = _mech(n, 3, eps, seed)
    x = data.draw(st.integers(0, n - 1))
    x2 = data.draw(st.integers(0, n - 1))
    rng = np.random.default_rng(seed)
    k = 30_000
    a = np.bincount(m.perturb_ids([x] * k, rng), minlength=n) / k
    b = np.bincount(m.perturb_ids([x2] * k, rng), minlength=n) / k
    # the sampler draws from the stated distribution ...
    expected = np.exp(m.log_probabilities([x, x2]))
    assert np.abs(a - expected[0]).sum() < 0.03 and np.abs(b - expected[1]).sum() < 0.03
    # ... and outputs seen often enough to estimate have empirical loss within eps (+ sampling slack)
    ok = (a * k >= 300) & (b * k >= 300)
    assert ok.any()
    emp = np.max(np.abs(np.log(a[ok]) - np.log(b[ok])))
    assert emp <= eps + 0.3


def test_query_epsilon_composes_over_tokens_and_low_eps_hides_the_query():
    vocab = ["<unk>", "how", "many", "apples", "does", "tom", "have", "?"]
    m = ExponentialTokenMechanism.word_level(vocab, np.random.default_rng(0).normal(size=(8, 4)), 2.5)
    q = "how many apples does tom have ?"
    assert m.query_epsilon(q) == pytest.approx(2.5 * 7)
    rng = np.random.default_rng(1)
    outs = [m.perturb(q, rng) for _ in range(50)]
    assert all(o.epsilon == pytest.approx(17.5) and o.n_tokens == 7 for o in outs)
    assert sum(o.text == q for o in outs) < 5  # at eps 2.5/token the exact query almost never survives
    high = ExponentialTokenMechanism.word_level(vocab, np.random.default_rng(0).normal(size=(8, 4)), 200.0)
    assert high.perturb(q, rng).text == q


def test_bad_epsilon_is_refused():
    with pytest.raises(ValueError, match="epsilon"):
        _mech(3, 2, 0.0, 0)
    with pytest.raises(ValueError, match="epsilon"):
        RandomizedResponse(float("inf"))


@pytest.mark.parametrize("eps", [0.5, 1.0, 3.0])
def test_randomized_response_ratio_is_e_to_the_eps(eps):
    rr = RandomizedResponse(eps)
    rng = np.random.default_rng(0)
    k = 40_000
    p1 = np.mean([rr.release(True, rng) for _ in range(k)])
    p0 = np.mean([rr.release(False, rng) for _ in range(k)])
    assert p1 == pytest.approx(math.exp(eps) / (1 + math.exp(eps)), abs=0.01)
    # both reports have empirical likelihood ratio within e^eps (+ slack)
    assert math.log(p1 / p0) <= eps + 0.1 and math.log((1 - p0) / (1 - p1)) <= eps + 0.1
    assert rr.probability(True, True) / rr.probability(True, False) == pytest.approx(math.exp(eps))


def test_length_buckets_release_only_the_bucket_and_charge_the_padded_length():
    vocab = ["<unk>", ".", "how", "many", "apples", "does", "tom", "have", "?"]
    emb = np.random.default_rng(0).normal(size=(len(vocab), 4))
    m = ExponentialTokenMechanism.word_level(vocab, emb, 2.0, length_bucket=8, pad_id=1)
    short, longer = "how many apples ?", "how many apples does tom have ?"  # 4 and 7 words
    rng = np.random.default_rng(0)
    a, b = m.perturb(short, rng), m.perturb(longer, rng)
    assert a.n_tokens == b.n_tokens == 8 and len(a.text.split()) == len(b.text.split()) == 8
    assert m.query_epsilon(short) == m.query_epsilon(longer) == pytest.approx(16.0)
    assert m.perturb("how " * 9, rng).n_tokens == 16 and m.perturb("", rng).n_tokens == 8
    plain = ExponentialTokenMechanism.word_level(vocab, emb, 2.0)
    assert plain.perturb(short, rng).n_tokens == 4  # without buckets the length is released
    with pytest.raises(ValueError, match="length_bucket"):
        ExponentialTokenMechanism.word_level(vocab, emb, 2.0, length_bucket=0)


def test_a_query_epsilon_is_spread_over_the_tokens():
    m = _mech(6, 3, 1.0, 0)
    out = m.perturb("w1 w2 w3", np.random.default_rng(0), epsilon=0.9)
    assert out.epsilon == pytest.approx(0.9) and out.n_tokens == 3
    with pytest.raises(ValueError, match="query epsilon"):
        m.perturb("w1", np.random.default_rng(0), epsilon=float("inf"))


def test_expected_keep_rate_is_exact_and_falls_with_epsilon():
    m = _mech(6, 3, 1.0, 0)
    text = "w1 w2 w3"
    ids = m.tokenize(text)
    rate = m.expected_keep_rate(text, epsilon=3.0)
    assert rate == pytest.approx(np.mean(np.exp(m.log_probabilities(ids, 1.0)[np.arange(3), ids])))
    rng = np.random.default_rng(0)
    sampled = np.mean([np.mean(np.array(m.perturb_ids(ids, rng, 1.0)) == ids) for _ in range(4000)])
    assert sampled == pytest.approx(rate, abs=0.02)
    assert m.expected_keep_rate(text, epsilon=0.3) < rate < m.expected_keep_rate(text, epsilon=300.0)
    assert m.expected_keep_rate(text, epsilon=0.0) == pytest.approx(1 / 6)
