import math

import numpy as np
import pytest

from llmkit.experiments import stats


def test_mean_ci_matches_t_interval_and_covers():
    rng = np.random.default_rng(0)
    cis = [stats.mean_ci(rng.normal(1.0, 2.0, 8)) for _ in range(400)]
    covered = sum(ci["lo"] <= 1.0 <= ci["hi"] for ci in cis)
    assert 0.92 <= covered / 400 <= 0.98  # a 95 % interval covers about 95 % of the time
    one = stats.mean_ci([3.0])
    assert one["lo"] == one["hi"] == 3.0 and one["n"] == 1
    with pytest.raises(ValueError):
        stats.mean_ci([])


def test_paired_diff_pairs_by_key_and_counts_direction():
    out = stats.paired_diff({0: 1.0, 1: 2.0, 2: 5.0}, {1: 3.0, 2: 4.0, 7: 0.0})
    assert out["keys"] == [1, 2] and out["diffs"] == [-1.0, 1.0] and out["a_lower"] == 1
    assert math.isclose(out["mean"], 0.0)
    with pytest.raises(ValueError, match="no key"):
        stats.paired_diff({0: 1.0}, {1: 1.0})


def test_wilson_and_proportion():
    lo, hi = stats.wilson(0, 10)
    assert lo == 0.0 and 0.2 < hi < 0.35  # Wilson never collapses to [0, 0] at k = 0
    p = stats.proportion_ci(7, 10)
    assert p["rate"] == 0.7 and p["lo"] < 0.7 < p["hi"]
    with pytest.raises(ValueError):
        stats.wilson(11, 10)


def test_auroc_direction_and_interval():
    rng = np.random.default_rng(1)
    s = np.r_[rng.normal(1, 1, 60), rng.normal(0, 1, 60)]
    y = np.r_[np.ones(60), np.zeros(60)]
    ci = stats.auroc_ci(s, y, n_resamples=200)
    assert 0.7 < ci["auroc"] < 0.9 and ci["low"] < ci["auroc"] < ci["high"]
    assert math.isclose(stats.auroc(-s, y), 1 - ci["auroc"])
    assert math.isnan(stats.auroc([1, 2], [1, 1]))


def test_bootstrap_ci_paired_difference():
    a = np.arange(40, dtype=float)
    out = stats.bootstrap_ci(40, lambda i: a[i].mean(), baseline=lambda i: (a[i] - 2).mean(), n_resamples=200)
    assert out["value"] == pytest.approx(2.0) and out["low"] == pytest.approx(2.0) and out["high"] == pytest.approx(2.0)


def test_mean_ci_of_equal_values_has_no_width():
    ci = stats.mean_ci([0.1 + 0.2] * 7)
    assert ci["std"] == 0.0 and ci["lo"] == ci["hi"] == ci["mean"]
