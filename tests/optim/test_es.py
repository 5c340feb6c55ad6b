"""Truncated Riemannian (1+1)-ES: stays on the manifold, sparse PCA on the sphere and on Stiefel, ahead of the
Euclidean ES projected back where the manifold has normal directions to drift in (Stiefel), level with it on the
sphere (one normal direction), and the sigma cap that makes it robust to a far too large sigma0."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from llmkit.optim.es import (
    RiemannianOnePlusOneES,
    cma_minimize,
    compare_on_sparse_pca,
    euclidean_one_plus_one_es,
    evaluations_to_target,
    overlap,
    project,
    sparse_pca_problem,
    summarize_evaluations,
)


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
        x, _, hist = RiemannianOnePlusOneES("sphere", 0.05, seed=s).minimize(f, _x0(30, s), 600)
        hits.append(abs(x @ u1) >= 0.95)
        assert len(hist) == 600 and all(b <= a for a, b in itertools.pairwise(hist))
    assert np.mean(hits) >= 0.85


def test_ahead_of_euclidean_es_on_stiefel():
    # leading 5-dim eigenspace of a 10 x 10 covariance on St(10, 5): tangent dim 35 vs ambient 50
    gaps_r, gaps_e = [], []
    for s in range(6):
        rng = np.random.default_rng(s)
        g = rng.standard_normal((10, 10))
        a = g @ g.T / 10
        opt = -np.linalg.eigvalsh(a)[-5:].sum()

        def f(x, a=a):
            return float(-np.trace(x.T @ a @ x))

        x0 = project(rng.standard_normal((10, 5)), "stiefel")
        gaps_r.append(RiemannianOnePlusOneES("stiefel", 0.05, seed=s).minimize(f, x0, 600)[1] - opt)
        gaps_e.append(euclidean_one_plus_one_es(f, x0, 600, 0.05, manifold="stiefel", seed=s)[1] - opt)
    assert np.median(gaps_r) < 0.5 * np.median(gaps_e)


def test_ahead_of_euclidean_es_projected_back_on_sparse_pca():
    # 8-component sparse PCA over St(12, 8): 36 of the 96 ambient directions are normal to
    # the manifold; success (subspace overlap >= 0.95) and budget fixed before the run, median over 6 seeds
    r = compare_on_sparse_pca(12, p=8, seeds=6, budget=800, methods=("riemannian", "euclidean"))
    rie = summarize_evaluations(r["riemannian"]["evals"], 800)
    euc = summarize_evaluations(r["euclidean"]["evals"], 800)
    assert rie["success_rate"] == 1.0 and min(r["riemannian"]["overlap"]) >= 0.95
    assert rie["median"] < 0.8 * euc["median"]
    assert rie["q3"] < euc["q3"]


def test_level_with_euclidean_es_on_the_sphere():
    # one normal (radial) direction: the ambient ES projected back is the same search up to a step-size constant
    r = compare_on_sparse_pca(30, seeds=6, budget=600, methods=("riemannian", "euclidean"))
    rie = summarize_evaluations(r["riemannian"]["evals"], 600)
    euc = summarize_evaluations(r["euclidean"]["evals"], 600)
    assert rie["success_rate"] == euc["success_rate"] == 1.0
    assert 0.75 < rie["median"] / euc["median"] < 1.33


def test_sigma_cap_saves_evaluations_when_sigma0_is_far_too_large():
    hits = {True: [], False: []}
    for s in range(6):
        f, _, u1 = sparse_pca_problem(n=50, seed=s)
        for clamp in (True, False):
            es = RiemannianOnePlusOneES("sphere", 3.0, clamp=clamp, seed=s)
            hit, _ = evaluations_to_target(lambda g, es=es, s=s: es.minimize(g, _x0(50, s), 1500), f,
                                           lambda x, u1=u1: overlap(x, u1), 0.95)
            hits[clamp].append(hit or 1501)
    assert np.median(hits[True]) < np.median(hits[False]) - 50
    es = RiemannianOnePlusOneES("sphere", 3.0, seed=0)
    es.minimize(lambda x: float(x[0]), _x0(50, 0), 5)
    assert es.sigma <= es.truncation_radius / np.sqrt(49) + 1e-12


def test_sparse_pca_stiefel_instance_and_target_bookkeeping():
    f, _, u = sparse_pca_problem(n=12, k=5, seed=0, p=4)
    assert u.shape == (12, 4) and np.allclose(u.T @ u, np.eye(4))
    assert overlap(u, u) == pytest.approx(1.0)
    x = project(np.random.default_rng(0).standard_normal((12, 4)), "stiefel")
    assert f(u) < f(x) and overlap(x, u) < 0.9
    calls = []

    def run(g):  # evaluates a random point, then the answer, then the random point again
        for y in (x, u, x):
            calls.append(g(y))

    hit, best = evaluations_to_target(run, f, lambda y: overlap(y, u), 0.95)
    assert hit == 2 and best == pytest.approx(1.0) and len(calls) == 3
    assert evaluations_to_target(lambda g: g(x), f, lambda y: overlap(y, u), 0.95)[0] is None
    s = summarize_evaluations([10, None, 30], budget=100)
    assert s["success_rate"] == pytest.approx(2 / 3) and s["median"] == 30 and s["q3"] > 30
    with pytest.raises(ValueError, match="p <= n"):
        sparse_pca_problem(n=3, p=4)
    with pytest.raises(ValueError, match="one shape"):
        overlap(x, u[:, :2])
    with pytest.raises(ValueError, match="unknown method"):
        compare_on_sparse_pca(5, seeds=1, budget=5, methods=("adam",))


def test_cma_baseline_runs_within_budget():
    f, _, _ = sparse_pca_problem(n=10, seed=0)
    x, fx, hist = cma_minimize(f, _x0(10, 0), 200, 0.3)
    assert len(hist) <= 200 and abs(np.linalg.norm(x) - 1) < 1e-9 and fx == pytest.approx(f(x))


def test_rejects_points_off_the_manifold():
    with pytest.raises(ValueError):
        RiemannianOnePlusOneES("sphere", 0.1).minimize(lambda x: 0.0, np.ones(3), 5)
    with pytest.raises(ValueError):
        RiemannianOnePlusOneES("torus", 0.1)
