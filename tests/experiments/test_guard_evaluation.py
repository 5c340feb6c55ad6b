"""Guard evaluation statistics: hash splits, AUROC intervals, aggregate intervals, per-layer dispersion."""

import numpy as np
import pytest

from llmkit.experiments import guard as E
from llmkit.experiments import stats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_split_is_stable_and_follows_the_fractions():
    parts = [E.split(f"item-{i}") for i in range(4000)]
    assert parts == [E.split(f"item-{i}") for i in range(4000)]
    for name, frac in zip(("fit", "val", "test"), (0.4, 0.2, 0.4)):
        assert parts.count(name) / 4000 == pytest.approx(frac, abs=0.03)
    assert {E.split(f"k{i}", (0.5, 0.5), ("a", "b")) for i in range(50)} == {"a", "b"}
    with pytest.raises(ValueError, match="sum to 1"):
        E.split("x", (0.5, 0.6, 0.1))


def test_auroc_ci_known_values():
    r = stats.auroc_ci([0.9, 0.8, 0.7, 0.1, 0.2, 0.3], [1, 1, 1, 0, 0, 0], n_resamples=200)
    assert r["auroc"] == 1.0 and r["low"] == 1.0 and r["n_pos"] == 3
    rng = np.random.default_rng(0)
    s = np.r_[rng.normal(1, 1, 200), rng.normal(0, 1, 200)]
    y = np.r_[np.ones(200), np.zeros(200)]
    r = stats.auroc_ci(s, y, n_resamples=300)
    # AUROC of N(1,1) vs N(0,1) is Phi(1/sqrt 2) = 0.760
    assert r["low"] < 0.760 < r["high"] and r["high"] - r["low"] < 0.15
    assert np.isnan(stats.auroc_ci([1, 2], [0, 0])["auroc"])
    with pytest.raises(ValueError, match="differ in length"):
        stats.auroc_ci([1, 2, 3], [0, 1])


def test_aggregate_ci_mean_and_paired_difference():
    rng = np.random.default_rng(1)
    a = rng.binomial(1, 0.5, 300).astype(float)
    b = np.clip(a + rng.binomial(1, 0.2, 300), 0, 1)  # b = a plus some fixes: a paired gain
    r = stats.bootstrap_ci(300, lambda i: a[i].mean(), n_resamples=300)
    assert r["value"] == pytest.approx(a.mean()) and r["low"] < a.mean() < r["high"]
    d = stats.bootstrap_ci(300, lambda i: b[i].mean(), baseline=lambda i: a[i].mean(), n_resamples=300)
    assert d["value"] == pytest.approx(b.mean() - a.mean()) and d["low"] > 0
    with pytest.raises(ValueError, match="at least 2 rows"):
        stats.bootstrap_ci(1, lambda i: 0.0)


def test_realized_fpr():
    assert E.realized_fpr([0.1, 0.5, 0.9, 1.0], 0.5) == 0.5
    with pytest.raises(ValueError, match="no compliant scores"):
        E.realized_fpr([], 0.0)


def test_dispersion_by_layer_removes_group_offsets():
    # within each task both classes have the same spread, but the violations come from two tasks far apart
    # and the compliant answers from one: uncentred they look scattered, centred per task they do not
    rng = np.random.default_rng(2)
    groups = ["a"] * 60 + ["b"] * 20
    labels = [0] * 50 + [1] * 10 + [1] * 20
    x = rng.normal(size=(80, 4))
    x[60:] += 6.0
    raw = E.dispersion_by_layer({1: x}, labels, n_components=4, estimators=["trace"], n_resamples=0)
    centred = E.dispersion_by_layer({1: x}, labels, groups=groups, n_components=4, estimators=["trace"],
                                    n_resamples=0)
    assert raw[1]["trace"]["ratio"] > 1.5
    assert centred[1]["trace"]["ratio"] == pytest.approx(1.0, abs=0.35)
    none = E.dispersion_by_layer({1: x}, [None] * 20 + labels[20:], n_components=4, estimators=["trace"],
                                 n_resamples=0)
    assert none[1]["n_compliant"] + none[1]["n_violating"] == 60


def test_cross_validated_auroc_scores_every_item_out_of_fold():
    import torch

    from llmkit.serving.guard import Capture

    rng = torch.Generator().manual_seed(0)

    def cap(scale, shift):
        return Capture(states={1: torch.randn(6, 8, generator=rng) * scale + shift}, n_tokens=6)

    caps = [cap(1.0, 0.0) for _ in range(40)] + [cap(3.0, 2.0) for _ in range(12)]
    labels = [0] * 40 + [1] * 12
    keys = [f"item{i}" for i in range(52)]
    r = E.cross_validated_auroc(caps, labels, keys, n_folds=4, model_name="x", hidden_size=8, num_layers=1,
                                n_components=4)
    assert set(r) == {"energy", "entropic"} and min(r.values()) > 0.9
    with pytest.raises(ValueError, match="differ in length"):
        E.cross_validated_auroc(caps, labels[:-1], keys)
