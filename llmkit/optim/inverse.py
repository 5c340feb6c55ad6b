"""Noiseless inverse optimization: recover a linear objective from demonstrations of optimal choices.

Paper: "noiseless inverse optimization" (NeurIPS 2026). A decision maker picks, in each
demonstration t, the action maximising ``theta* . phi`` among the feasible actions' feature vectors; IO infers
theta from the (context, action) data. Any estimator consistent with the data generalises: the induced
action set errs with probability O(d/T) (d unknowns, T demonstrations), a rate that is tight; the paper also
proposes a parameter-free algorithm with lower per-iteration cost than generic solvers.

The consistent set is the cone ``C = {theta : theta . (phi_chosen - phi_j) >= 0 for every t, j}``.
``fit_objective`` returns a point of it:

* ``method="perceptron"`` (default; the parameter-free algorithm here): the batch fixed-increment perceptron.
  Start from the mean normalised difference; while some demonstration prefers another action j, add the sum
  of all violated normalised differences ``(phi_chosen - phi_j) / ||.||``. No step size to tune (the cone is
  scale-free), one matrix-vector product per iteration (O(sum_t k_t d)), and it stops at a consistent theta;
  when the chosen actions are strict optima the cone has an interior and the number of iterations is finite
  (Novikoff's bound, 1 / margin^2, is the worst case; in practice a few dozen).
* ``method="lp"`` (generic-solver baseline): the max-margin point, ``max s`` subject to
  ``theta . (phi_chosen - phi_j) / ||phi_chosen - phi_j|| >= s`` and ``-1 <= theta <= 1`` (scipy HiGHS).

Deviations: the abstract does not describe its algorithm; the perceptron is our parameter-free stand-in with
the same per-iteration cost profile. ``contexts`` are optional: features already describe each candidate in
its context; pass ``feature_map(context, candidates) -> features`` to build them from raw contexts.
Ties (actions with the same feature vector as the chosen one) carry no information and are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["decision_error", "fit_objective", "predict_actions"]


def _differences(contexts, actions, feasible_actions, feature_map) -> np.ndarray:
    if len(actions) != len(feasible_actions):
        raise ValueError(f"{len(actions)} actions for {len(feasible_actions)} demonstrations")
    if contexts is not None and len(contexts) != len(actions):
        raise ValueError(f"{len(contexts)} contexts for {len(actions)} demonstrations")
    rows, d = [], None
    for t, (a, cands) in enumerate(zip(actions, feasible_actions)):
        phi = np.asarray(cands, dtype=np.float64)
        if feature_map is not None:
            phi = np.asarray(feature_map(None if contexts is None else contexts[t], phi), dtype=np.float64)
        if phi.ndim != 2:
            raise ValueError(f"feasible_actions[{t}] must be a k x d array, got shape {phi.shape}")
        if d is None:
            d = phi.shape[1]
        elif phi.shape[1] != d:
            raise ValueError(f"feasible_actions[{t}] has {phi.shape[1]} features, expected {d}")
        a = int(a)
        if not 0 <= a < len(phi):
            raise ValueError(f"actions[{t}] = {a} is not an index into its {len(phi)} feasible actions")
        diff = phi[a][None] - np.delete(phi, a, axis=0)
        rows.append(diff[np.linalg.norm(diff, axis=1) > 1e-12])
    if d is None:
        raise ValueError("no demonstrations")
    return np.concatenate(rows) if rows else np.zeros((0, d))


def fit_objective(contexts, actions: Sequence[int], feasible_actions: Sequence[np.ndarray], *,
                  method: str = "perceptron", max_iter: int = 10000, normalize: bool = True,
                  feature_map: Callable | None = None, seed: int = 0) -> np.ndarray:
    """Recover theta (length d, unit norm when ``normalize``) with ``theta . phi[actions[t]]`` maximal among
    ``feasible_actions[t]`` for every demonstration t. See the module docstring for the methods."""
    D = _differences(contexts, actions, feasible_actions, feature_map)
    d = D.shape[1]
    if len(D) == 0:
        theta = np.ones(d) / np.sqrt(d)
        return theta
    Dn = D / np.linalg.norm(D, axis=1, keepdims=True)
    if method == "lp":
        from scipy.optimize import linprog

        # variables [theta (d), s]; maximise s
        A_ub = np.hstack([-Dn, np.ones((len(Dn), 1))])
        res = linprog(np.r_[np.zeros(d), -1.0], A_ub=A_ub, b_ub=np.zeros(len(Dn)),
                      bounds=[(-1, 1)] * d + [(None, None)], method="highs")
        if res.status != 0:
            raise RuntimeError(f"linprog failed: {res.message}")
        theta = res.x[:d]
    elif method == "perceptron":
        theta = Dn.mean(0)
        for _ in range(max_iter):
            wrong = Dn @ theta <= 0
            if not wrong.any():
                break
            theta = theta + Dn[wrong].sum(0)
    else:
        raise ValueError(f"method must be 'perceptron' or 'lp', got {method!r}")
    if normalize:
        nrm = np.linalg.norm(theta)
        theta = theta / nrm if nrm > 0 else theta
    return theta


def predict_actions(theta: np.ndarray, feasible_actions: Sequence[np.ndarray]) -> np.ndarray:
    """Index of the best action under theta in each demonstration."""
    return np.array([int(np.argmax(np.asarray(f, dtype=np.float64) @ theta)) for f in feasible_actions])


def decision_error(theta_hat: np.ndarray, theta_true: np.ndarray, feasible_actions: Sequence[np.ndarray]) -> float:
    """Fraction of demonstrations where theta_hat's choice differs from theta_true's (held-out error)."""
    return float(np.mean(predict_actions(theta_hat, feasible_actions) != predict_actions(theta_true, feasible_actions)))
