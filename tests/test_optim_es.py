"""Truncated Riemannian (1+1)-ES: stays on the manifold, sparse PCA on the sphere, ahead of the ambient ES."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.optim.es import (RiemannianOnePlusOneES, cma_minimize, euclidean_one_plus_one_es, project,
                             sparse_pca_problem)


def _x0(n, seed):
    x = np.random.default_rng(100 + seed).standard_normal(n)
    return x / np.linalg.norm(x)


def test_iterates_stay_on_the_manifold():
    seen = []
    es = RiemannianOnePlusOneES("sphere", 0.3, truncation_radius=0.5, seed=0)
    es.minimize(lambda x: seen.append(x.copy()) or float(x[0]), _x0(8, 0), 60)
    assert max(abs(np.linalg.norm(x) - 1) for x in seen) < 1e-9
    seen = []
    x0 = project(np.random.default_rng(1).standard_normal((6, 3)), "stiefel")
    RiemannianOnePlusOneES("stiefel", 0.2, seed=0).minimize(lambda x: seen.append(x.copy()) or float(x[0, 0]), x0,
                                                            60)
    assert max(np.abs(x.T @ x - np.eye(3)).max() for x in seen) < 1e-9


def test_comparison_based_invariant_to_monotone_transform():
    f, _, _ = sparse_pca_problem(n=10, seed=0)
    a = RiemannianOnePlusOneES("sphere", 0.1, seed=3).minimize(f, _x0(10, 0), 150)[0]
    b = RiemannianOnePlusOneES("sphere", 0.1, seed=3).minimize(lambda x: np.exp(f(x)), _x0(10, 0), 150)[0]
    assert np.allclose(a, b)


def test_sparse_pca_on_sphere_finds_leading_eigenvector():
    hits = []
    for s in range(8):
        f, _, u1 = sparse_pca_problem(n=30, seed=s)
        x, fx, hist = RiemannianOnePlusOneES("sphere", 0.05, seed=s).minimize(f, _x0(30, s), 600)
        hits.append(abs(x @ u1) >= 0.95)
        assert len(hist) == 600 and all(b <= a for a, b in zip(hist, hist[1:]))
    assert np.mean(hits) >= 0.85


def test_ahead_of_euclidean_es_on_stiefel():
    # leading 5-dim eigenspace of a 10 x 10 covariance on St(10, 5): tangent dim 35 vs ambient 50
    gaps_r, gaps_e = [], []
    for s in range(6):
        rng = np.random.default_rng(s)
        g = rng.standard_normal((10, 10))
        a = g @ g.T / 10
        opt = -np.linalg.eigvalsh(a)[-5:].sum()

        def f(x):
            return float(-np.trace(x.T @ a @ x))

        x0 = project(rng.standard_normal((10, 5)), "stiefel")
        gaps_r.append(RiemannianOnePlusOneES("stiefel", 0.05, seed=s).minimize(f, x0, 600)[1] - opt)
        gaps_e.append(euclidean_one_plus_one_es(f, x0, 600, 0.05, manifold="stiefel", seed=s)[1] - opt)
    assert np.median(gaps_r) < 0.5 * np.median(gaps_e)


def test_cma_baseline_runs_within_budget():
    f, _, u1 = sparse_pca_problem(n=10, seed=0)
    x, fx, hist = cma_minimize(f, _x0(10, 0), 200, 0.3)
    assert len(hist) <= 200 and abs(np.linalg.norm(x) - 1) < 1e-9 and fx == pytest.approx(f(x))


def test_rejects_points_off_the_manifold():
    with pytest.raises(ValueError):
        RiemannianOnePlusOneES("sphere", 0.1).minimize(lambda x: 0.0, np.ones(3), 5)
    with pytest.raises(ValueError):
        RiemannianOnePlusOneES("torus", 0.1)
