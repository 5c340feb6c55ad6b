"""Noiseless inverse optimization: consistency with the demonstrations, held-out decision error falling as
d/T (the paper's rate, on its setting: random feasible sets, a planted linear objective), and the llmkit use:
recovering planted reward weights from simulated preference pairs."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.optim.inverse import decision_error, fit_objective, predict_actions
from llmkit.rewards.preferences import infer_reward_weights, pairwise_agreement, simulate_preference_pairs


def _demos(T, d, k, rng, theta):
    feas = [rng.normal(size=(k, d)) for _ in range(T)]
    return feas, [int(np.argmax(f @ theta)) for f in feas]


@pytest.mark.parametrize("method", ["perceptron", "lp"])
def test_fit_objective_is_consistent_with_every_demonstration(method):
    rng = np.random.default_rng(0)
    theta = rng.normal(size=6)
    feas, acts = _demos(300, 6, 8, rng, theta)
    est = fit_objective(None, acts, feas, method=method)
    assert np.isclose(np.linalg.norm(est), 1.0)
    assert predict_actions(est, feas).tolist() == acts
    assert est @ theta / np.linalg.norm(theta) > 0.95


def _mean_heldout_error(T, d, reps=6, k=10, method="perceptron"):
    errs = []
    for rep in range(reps):
        rng = np.random.default_rng(1000 * T + rep)
        theta = rng.normal(size=d)
        feas, acts = _demos(T, d, k, rng, theta)
        test, _ = _demos(2000, d, k, rng, theta)
        errs.append(decision_error(fit_objective(None, acts, feas, method=method), theta, test))
    return float(np.mean(errs))


def test_heldout_error_falls_roughly_as_d_over_T():
    Ts = [25, 50, 100, 200, 400]
    errs = [_mean_heldout_error(T, 5) for T in Ts]
    slope = np.polyfit(np.log(Ts), np.log(errs), 1)[0]
    assert -1.4 < slope < -0.65, (errs, slope)
    # and grows with d at fixed T (about linearly)
    e_small, e_big = _mean_heldout_error(100, 3), _mean_heldout_error(100, 12)
    assert 2.0 < e_big / e_small < 8.0, (e_small, e_big)
    # T * err / d stays bounded by a constant
    assert max(T * e / 5 for T, e in zip(Ts, errs)) < 2.0


def test_contexts_and_feature_map():
    rng = np.random.default_rng(3)
    theta = np.array([1.0, -2.0, 0.5])
    contexts = rng.normal(size=(200, 3))
    raw = [rng.normal(size=(5, 3)) for _ in range(200)]
    feats = [r * c for r, c in zip(raw, contexts)]                     # features depend on the context
    acts = [int(np.argmax(f @ theta)) for f in feats]
    est = fit_objective(contexts, acts, raw, feature_map=lambda c, r: r * c)
    assert est @ theta / np.linalg.norm(theta) > 0.98
    with pytest.raises(ValueError, match="not an index"):
        fit_objective(None, [7], [np.zeros((3, 2))])


def test_infer_reward_weights_recovers_planted_weights_from_preference_pairs():
    planted = np.array([2.0, 0.5, 1.0, 0.2])                             # e.g. correctness, format, length, style
    pref, rej = simulate_preference_pairs(planted, 400, seed=0, binary=(0, 1))
    w = np.asarray(infer_reward_weights(pref, rej))
    assert np.isclose(np.abs(w).mean(), 1.0)
    cos = w @ planted / (np.linalg.norm(w) * np.linalg.norm(planted))
    assert cos > 0.99
    assert pairwise_agreement(w, pref, rej) >= 0.99 - 1e-12             # consistent on the training pairs
    test_p, test_r = simulate_preference_pairs(planted, 5000, seed=1, binary=(0, 1))
    nontie = np.abs((test_p - test_r) @ planted) > 1e-9
    assert pairwise_agreement(w, test_p[nontie], test_r[nontie]) > 0.97
    # uniform weights (the TRL default) are clearly worse on the same pairs
    assert pairwise_agreement(np.ones(4), test_p[nontie], test_r[nontie]) < 0.93
