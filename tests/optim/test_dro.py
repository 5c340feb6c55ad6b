"""TC-DRO weights: their defining properties, the exact chi-square worst case, and the paper's claim on an
imbalanced regression toy (tail MSE below ERM and below global chi-square DRO; Wasserstein weights = ERM)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from llmkit.optim import dro


def test_regions_are_equal_width_target_ranges():
    y = np.array([0.0, 0.1, 0.2, 0.95, 1.0, 5.0, 9.9, 10.0])
    r = dro.target_regions(y, num_regions=10)
    assert r.tolist() == [0, 0, 0, 0, 1, 2, 3, 3]     # bins [0,1) [1,2) [5,6) [9,10], empty bins dropped
    assert dro.target_regions(np.ones(4), 5).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_tc_dro_weights_properties(seed):
    rng = np.random.default_rng(seed)
    y = np.concatenate([rng.normal(0, 1, 500), rng.normal(6, 0.3, 15)])   # a dense bulk and a rare range
    losses = rng.exponential(1.0, len(y))
    w = dro.tc_dro_weights(y, losses, num_regions=8, radius=0.2)
    assert w.shape == y.shape and np.all(w >= 0) and np.isclose(w.sum(), len(y))
    region = dro.target_regions(y, 8)
    counts = np.bincount(region)
    means = np.array([w[region == k].mean() for k in range(len(counts))])
    # scarcer regions get a larger mean weight (strictly, when counts differ)
    for a in range(len(counts)):
        for b in range(len(counts)):
            if counts[a] < counts[b]:
                assert means[a] > means[b]
    # within a region the weights tilt towards larger losses
    big = region == np.argmax(counts)
    order = np.argsort(losses[big])
    assert np.all(np.diff(w[big][order]) >= -1e-12)
    # radius 0: ERM
    assert np.allclose(dro.tc_dro_weights(y, losses, radius=0.0), 1.0)


@pytest.mark.parametrize("radius", [0.05, 0.3, 2.0])
def test_chi2_worst_case_matches_a_generic_solver(radius):
    rng = np.random.default_rng(1)
    ell = rng.exponential(1.0, 12)
    n = len(ell)
    w = dro.chi2_worst_case_weights(ell, radius)
    assert np.isclose(w.sum(), n) and np.all(w >= 0)
    assert 0.5 * np.mean((w - 1) ** 2) <= radius + 1e-8
    cons = [{"type": "eq", "fun": lambda p: p.sum() - 1},
            {"type": "ineq", "fun": lambda p: radius - 0.5 * np.mean((n * p - 1) ** 2)}]
    res = minimize(lambda p: -p @ ell, np.full(n, 1 / n), constraints=cons, bounds=[(0, 1)] * n,
                   method="SLSQP", options={"ftol": 1e-12, "maxiter": 500})
    assert w @ ell / n == pytest.approx(-res.fun, rel=1e-5)
    assert np.allclose(dro.wasserstein_dro_weights(ell), 1.0)


def _tail_mse(beta, X, y, mask):
    pred = beta[0] + X @ beta[1:]
    return float(np.mean((pred - y)[mask] ** 2))


@pytest.mark.parametrize("seed", range(3))
def test_tc_dro_lowers_tail_mse_against_erm_and_global_chi2(seed):
    X, y = dro.imbalanced_regression_toy(3000, seed=seed)
    Xt, yt = dro.imbalanced_regression_toy(20000, seed=100 + seed)
    tail = dro.tail_mask(y, yt, 0.1)
    assert 0.03 < tail.mean() < 0.3
    radius = 0.1
    erm = _tail_mse(dro.fit_weighted_linear(X, y), Xt, yt, tail)
    chi = _tail_mse(dro.fit_weighted_linear(X, y, lambda t, l: dro.chi2_dro_weights(l, radius)), Xt, yt, tail)
    tc = _tail_mse(dro.fit_weighted_linear(X, y, lambda t, l: dro.tc_dro_weights(t, l, 10, radius)), Xt, yt, tail)
    wass = _tail_mse(dro.fit_weighted_linear(X, y, lambda t, l: dro.wasserstein_dro_weights(l, radius)),
                     Xt, yt, tail)
    assert wass == pytest.approx(erm)                 # uniform weights: Wasserstein reweighting is ERM
    assert tc < 0.95 * erm
    assert tc < 0.98 * chi


def test_difficulty_regressor_parses_steps_and_learns_from_question_text():
    from llmkit.train.difficulty import DifficultyRegressor, solution_steps

    assert solution_steps("a = <<1+1=2>>2\n\nb = 3\n#### 3") == 2
    rng = np.random.default_rng(0)
    questions, steps = [], []
    for _ in range(300):
        k = int(rng.choice([2, 2, 2, 3, 3, 4, 7]))              # imbalanced step counts
        nums = " and ".join(str(int(x)) for x in rng.integers(1, 99, k))
        questions.append(f"Tom buys {nums} apples" + (" then sells some twice" if k > 4 else ""))
        steps.append(k)
    for w in ("erm", "chi2", "tc_dro"):
        pred = DifficultyRegressor(weighting=w).fit(questions, steps).predict(questions)
        long_ = np.array(steps) == 7
        assert pred[long_].mean() > pred[~long_].mean() + 2.0
    with pytest.raises(ValueError, match="weighting"):
        DifficultyRegressor(weighting="focal")
