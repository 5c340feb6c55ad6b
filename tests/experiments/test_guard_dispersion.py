"""Dispersion estimators behind AEO's asymmetry measurement, on synthetic data with known answers."""

import math

import numpy as np
import pytest

from llmkit.experiments import guard_dispersion as D


def test_gaussian_entropy_matches_closed_form():
    rng = np.random.default_rng(0)
    d, sigma = 4, 2.0
    x = rng.normal(scale=sigma, size=(4000, d))
    want = 0.5 * d * math.log(2 * math.pi * math.e * sigma**2)
    assert D.gaussian_entropy(x) == pytest.approx(want, abs=0.05)
    assert D.knn_entropy(x, k=3) == pytest.approx(want, abs=0.15)


def test_knn_entropy_of_uniform_cube():
    rng = np.random.default_rng(1)
    x = rng.uniform(0, 3, size=(3000, 2))  # entropy log(9)
    assert D.knn_entropy(x) == pytest.approx(math.log(9), abs=0.1)


def test_knn_spread_measures_a_repeated_row_once():
    x = np.random.default_rng(1).normal(size=(40, 3))
    with_repeats = np.concatenate([x, x[:5]])
    assert D.entropy_per_dim(with_repeats, "knn") == pytest.approx(D.entropy_per_dim(x, "knn"))


def test_knn_entropy_refuses_repeated_rows_and_bad_k():
    x = np.zeros((10, 3))
    with pytest.raises(ValueError, match="repeated rows"):
        D.knn_entropy(x)
    with pytest.raises(ValueError, match="k must be"):
        D.knn_entropy(np.random.default_rng(0).normal(size=(5, 2)), k=5)


@pytest.mark.parametrize("est", D.ESTIMATORS)
def test_compare_recovers_known_scale_ratio(est):
    # violating rows have 1.5x the standard deviation in every direction: entropy power ratio 2.25
    rng = np.random.default_rng(2)
    d = 6
    c = rng.normal(size=(300, d))
    v = rng.normal(scale=1.5, size=(300, d))
    r = D.compare(c, v, n_components=d, estimators=[est], n_draws=5, n_resamples=100)
    assert r[est]["ratio"] == pytest.approx(2.25, rel=0.25)
    if est == "trace":
        assert r[est]["ci_low"] < 2.25 < r[est]["ci_high"]
        assert r[est]["ci_low"] > 1.0


def test_compare_equal_groups_give_ratio_near_one_and_is_symmetric():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(200, 5)), rng.normal(size=(200, 5))
    r = D.compare(a, b, n_components=5, estimators=["logdet", "trace"], n_draws=5, n_resamples=100)
    for est in ("logdet", "trace"):
        assert r[est]["ratio"] == pytest.approx(1.0, abs=0.25)
    assert r["trace"]["ci_low"] < 1.0 < r["trace"]["ci_high"]
    swapped = D.compare(b, a, n_components=5, estimators=["trace"], n_draws=5, n_resamples=0)
    assert swapped["trace"]["log_ratio"] == pytest.approx(-r["trace"]["log_ratio"], abs=0.05)


def test_compare_balances_group_sizes():
    # same distribution, very different sizes: the balanced, cross-fitted logdet ratio stays near 1
    # (a basis fitted on all 25 small-group rows would read them as ~1.6x more spread)
    rng = np.random.default_rng(4)
    c, v = rng.normal(size=(400, 20)), rng.normal(size=(25, 20))
    r = D.compare(c, v, n_components=8, estimators=["logdet"], n_draws=20, n_resamples=0)
    assert r["n_balanced"] == 25
    assert r["logdet"]["ratio"] == pytest.approx(1.0, abs=0.3)


def test_compare_uses_pooled_axes_high_dimensional():
    # 50 responses in 200 dims, violations spread along extra directions: detected in the pooled PCA space
    rng = np.random.default_rng(5)
    d = 200
    c = rng.normal(size=(50, d)) * 0.5
    v = rng.normal(size=(50, d)) * 0.5
    v[:, :5] += rng.normal(scale=4.0, size=(50, 5))
    r = D.compare(c, v, n_components=8, estimators=["logdet", "trace"], n_draws=5, n_resamples=100)
    assert r["logdet"]["ratio"] > 2 and r["trace"]["ratio"] > 2


def test_compare_errors_name_the_problem():
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match="differ in width"):
        D.compare(rng.normal(size=(10, 3)), rng.normal(size=(10, 4)))
    with pytest.raises(ValueError, match="at least 6 responses"):
        D.compare(rng.normal(size=(10, 3)), rng.normal(size=(5, 3)))
    with pytest.raises(ValueError, match="unknown dispersion estimator"):
        D.compare(rng.normal(size=(10, 3)), rng.normal(size=(10, 3)), estimators=["variance"])
    with pytest.raises(ValueError, match="2-D"):
        D.logdet_per_dim(np.zeros(5))
