"""beta-EB-TCI best-arm identification and noisy 1-D minimizer localization, in the papers' settings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmkit.optim.bandits import (
    TopTwoEBTCI,
    UniformAllocation,
    characteristic_time,
    identify_best,
    localize_minimizer,
)

MU = np.array([0.7, 0.5, 0.4, 0.3])  # Bernoulli instance with a unique best arm


def _run(mu, delta, seed, allocation="top-two", **kw):
    rng = np.random.default_rng(seed)
    return identify_best(lambda k: float(rng.random() < mu[k]), len(mu), delta, allocation=allocation, **kw)


def test_top_two_is_delta_correct_and_beats_uniform():
    delta = 0.1
    tt = [_run(MU, delta, s) for s in range(30)]
    un = [_run(MU, delta, s, allocation="uniform") for s in range(30)]
    assert np.mean([a == 0 for a, _ in tt]) >= 1 - delta
    assert np.mean([a == 0 for a, _ in un]) >= 1 - delta
    assert np.mean([n for _, n in tt]) < 0.85 * np.mean([n for _, n in un])


def test_forced_exploration_variant_is_correct():
    res = [_run(MU, 0.1, s, forced_exploration=True) for s in range(15)]
    assert np.mean([a == 0 for a, _ in res]) >= 0.9


def test_stopping_time_tracks_T_star_log_one_over_delta():
    t_star = characteristic_time(MU, 0.5)
    means = {}
    for delta in (1e-3, 1e-12):
        means[delta] = np.mean([_run(MU, delta, s)[1] for s in range(8)])
    r_big, r_small = (means[d] / (t_star * math.log(1 / d)) for d in (1e-3, 1e-12))
    assert r_small < r_big  # lower-order terms fade as delta shrinks
    assert 0.8 < r_small < 2.2
    slope = (means[1e-12] - means[1e-3]) / (t_star * (math.log(1e12) - math.log(1e3)))
    assert 0.6 < slope < 1.5


def test_characteristic_time_two_arms_closed_form():
    # two arms, beta = 1/2: 1/T* = (kl(mu1, m) + kl(mu2, m)) / 2 with m the average
    from llmkit.optim.bandits import kl_bernoulli

    mu = [0.6, 0.3]
    m = 0.45
    assert characteristic_time(mu, 0.5) == pytest.approx(2 / float(kl_bernoulli(0.6, m) + kl_bernoulli(0.3, m)),
                                                         rel=1e-6)


def test_interface_and_tracking_fraction():
    algo = TopTwoEBTCI(3, 0.05, beta=0.5)
    rng = np.random.default_rng(0)
    mu = [0.9, 0.2, 0.1]
    while not algo.should_stop():
        a = algo.next_arm()
        algo.update(a, float(rng.random() < mu[a]))
    assert algo.best_arm() == 0
    assert algo.counts.sum() == algo.t
    assert abs(algo.counts[0] / algo.t - 0.5) < 0.1  # the leader gets about beta of the pulls
    base = UniformAllocation(3, 0.05)
    with pytest.raises(ValueError):
        base.update(0, 1.5)
    with pytest.raises(ValueError):
        TopTwoEBTCI(1, 0.1)


def test_max_samples_caps_the_run():
    _arm, n = identify_best(lambda k: 0.5, 3, 0.05, max_samples=50)  # equal arms never separate
    assert n == 50


FUNCS = [
    ("quadratic", lambda x: 4 * (x - 0.3) ** 2, 0.3, 0.05),
    ("abs", lambda x: abs(x - 0.71), 0.71, 0.1),
    ("exp", lambda x: math.exp(x) - 2 * x, math.log(2), 0.02),
    ("boundary", lambda x: (x + 1.5) ** 2, -1.0, 0.1),
]


@pytest.mark.parametrize("name,f,xstar,sigma", FUNCS, ids=[f[0] for f in FUNCS])
def test_localize_minimizer_within_eps(name, f, xstar, sigma):
    eps, delta = 0.05, 0.1
    hits = []
    for s in range(12):
        rng = np.random.default_rng(s)
        x, evals = localize_minimizer(lambda x, rng=rng: f(x) + sigma * rng.standard_normal(), -1.0, 2.0, eps,
                                      delta, sigma=sigma)
        hits.append(abs(x - xstar) <= eps)
        assert evals > 0
    assert np.mean(hits) >= 1 - delta


def test_localization_cost_follows_sublevel_width():
    # Delta_eps(|x - c|) = eps >> Delta_eps(c2 (x - c)^2) = c2 eps^2: the sharp function needs fewer samples
    def cost(f):
        rng = np.random.default_rng(0)
        return localize_minimizer(lambda x: f(x) + 0.1 * rng.standard_normal(), 0.0, 1.0, 0.05, 0.1, sigma=0.1)[1]

    assert cost(lambda x: abs(x - 0.4)) * 3 < cost(lambda x: 4 * (x - 0.4) ** 2)


def test_max_evals_and_bad_input():
    x, n = localize_minimizer(lambda x: x * x, -1, 1, 1e-3, 0.1, max_evals=30)
    assert n <= 30 and -1 <= x <= 1
    with pytest.raises(ValueError):
        localize_minimizer(lambda x: x, 1, 0, 0.1, 0.1)
