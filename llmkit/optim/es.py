"""Comparison-based search on manifolds: the truncated Riemannian (1+1)-evolution strategy.

Seed: "(1+1)-evolution strategy ... truncated Riemannian (1+1)-ES on a compact Riemannian submanifold"
(non-asymptotic stationarity at the zeroth-order rate, with the Gaussian second-moment term scaling
with the intrinsic dimension d = dim M instead of the ambient n; numerical illustration: sparse PCA over
spheres). ``RiemannianOnePlusOneES(manifold="sphere"|"stiefel", sigma0, truncation_radius)``:

1. at the current point x draw a tangent Gaussian ``v ~ N(0, sigma^2 P_x)`` (P_x the orthogonal
   projection onto the tangent space, so v has d = dim M degrees of freedom);
2. truncate it: ``v <- v * min(1, R / ||v||)`` (R = ``truncation_radius``);
3. candidate ``y = Retr_x(v)`` (sphere: the exponential map ``cos|v| x + sin|v| v/|v|``; Stiefel: the
   polar retraction ``polar(X + V)``), so every iterate stays on the manifold;
4. keep y if ``f(y) <= f(x)`` (only the order of the two values is used: comparison-based);
5. adapt sigma by the 1/5-success rule (``exp((success - 1/5) / D)``, ``D = sqrt(d + 1)``).

Deviations from the paper: its analysis uses a fixed step ``sigma0``; here sigma adapts by the 1/5 rule
by default (``adapt=False`` gives the fixed-step method), which is what makes the method practical under
a small budget. R is an absolute radius that keeps each step inside a ball where the retraction is a good
chart (default pi/4 on the sphere, 0.5 on Stiefel). sigma is capped at ``R / sqrt(d)`` (``clamp=False``
turns the cap off): above it ``||v|| ~ sigma sqrt(d)`` exceeds R almost surely, so the truncated step is a
uniform tangent direction of length R whatever sigma is, and a larger sigma only costs the 1/5 rule
evaluations to shrink it back (tests check that the cap saves evaluations when sigma0 is far too large).

Baselines: ``euclidean_one_plus_one_es`` and ``cma_minimize`` (``cma``'s CMA-ES). The fair "Euclidean ES
projected back" is a Euclidean ES that does not know the manifold: its state (mean and sigma) lives in
R^n, it mutates isotropically in R^n with the ambient constants (D = sqrt(n + 1)), and because f is only
defined on M it evaluates f at the projection of each candidate, projecting its answer at the end. Its
iterate is never normalised: an ES that replaces its state by the projection after every step uses the
projection as a retraction and is a Riemannian ES in disguise.

What the comparison (``compare_on_sparse_pca``) can show: on the sphere the normal space is the single
radial direction (d = n - 1), f o proj is constant on rays and the ambient iterate's norm drift only rescales
its step isotropically, which the 1/5 rule absorbs, so little separates the two there. On St(n, p) a share
(p + 1) / (2n) of the ambient directions is normal to M and the ambient iterate drifts in them
anisotropically, so the gap should grow with that share. Measured: bench/results/select_quick.md
(keys ``es_sphere_*``, ``es_stiefel_*``, ``es_ratio_by_normal_share``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def project(x: np.ndarray, manifold: str) -> np.ndarray:
    """The nearest point on the manifold: x/||x|| (sphere) or the polar factor U V^T (Stiefel)."""
    if manifold == "sphere":
        return x / np.linalg.norm(x)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    return u @ vt


def tangent_project(x: np.ndarray, z: np.ndarray, manifold: str) -> np.ndarray:
    if manifold == "sphere":
        return z - x * float(x @ z)
    xtz = x.T @ z
    return z - x @ (0.5 * (xtz + xtz.T))


def retract(x: np.ndarray, v: np.ndarray, manifold: str) -> np.ndarray:
    if manifold == "sphere":
        t = float(np.linalg.norm(v))
        if t == 0.0:
            return x
        return math.cos(t) * x + math.sin(t) * (v / t)
    return project(x + v, "stiefel")


def intrinsic_dim(shape: tuple[int, ...], manifold: str) -> int:
    if manifold == "sphere":
        return shape[0] - 1
    n, p = shape
    return n * p - p * (p + 1) // 2


def _check_point(x0, manifold: str) -> np.ndarray:
    x = np.asarray(x0, dtype=float)
    if manifold == "sphere":
        if x.ndim != 1 or abs(np.linalg.norm(x) - 1.0) > 1e-6:
            raise ValueError("x0 on the sphere must be a unit-norm 1-D array")
    elif manifold == "stiefel":
        if x.ndim != 2 or x.shape[1] > x.shape[0] or not np.allclose(x.T @ x, np.eye(x.shape[1]), atol=1e-6):
            raise ValueError("x0 on Stiefel must be an n x p array with orthonormal columns (p <= n)")
    else:
        raise ValueError(f"manifold must be 'sphere' or 'stiefel' (got {manifold!r})")
    return x.copy()


class RiemannianOnePlusOneES:
    """Truncated Riemannian (1+1)-ES (module docstring); ``minimize(f, x0, budget) -> (x, fx, history)``.

    ``history[k]`` is the best value after k + 1 evaluations (``budget`` entries; the first is f(x0)).
    """

    def __init__(self, manifold: str = "sphere", sigma0: float = 0.3, truncation_radius: float | None = None,
                 *, adapt: bool = True, clamp: bool = True, seed: int | None = None):
        if manifold not in ("sphere", "stiefel"):
            raise ValueError(f"manifold must be 'sphere' or 'stiefel' (got {manifold!r})")
        if sigma0 <= 0:
            raise ValueError("sigma0 must be > 0")
        self.manifold = manifold
        self.sigma0 = float(sigma0)
        self.truncation_radius = float(truncation_radius if truncation_radius is not None
                                       else (math.pi / 4 if manifold == "sphere" else 0.5))
        self.adapt = adapt
        self.clamp = clamp
        self.rng = np.random.default_rng(seed)
        self.sigma = self.sigma0

    def minimize(self, f: Callable[[np.ndarray], float], x0, budget: int):
        x = _check_point(x0, self.manifold)
        if budget < 1:
            raise ValueError("budget must be >= 1")
        d = intrinsic_dim(x.shape, self.manifold)
        damp = math.sqrt(d + 1.0)
        # above this, ||v|| ~ sigma sqrt(d) exceeds R almost surely: the truncated step is a uniform direction
        # with length R whatever sigma is, so a larger sigma carries no information (see module docstring)
        cap = self.truncation_radius / math.sqrt(d) if self.clamp else math.inf
        sigma = min(self.sigma0, cap)
        fx = float(f(x))
        history = [fx]
        for _ in range(budget - 1):
            v = tangent_project(x, sigma * self.rng.standard_normal(x.shape), self.manifold)
            norm = float(np.linalg.norm(v))
            if norm > self.truncation_radius:
                v *= self.truncation_radius / norm
            y = retract(x, v, self.manifold)
            fy = float(f(y))
            success = fy <= fx
            if success:
                x, fx = y, fy
            if self.adapt:
                sigma = min(cap, sigma * math.exp(((1.0 if success else 0.0) - 0.2) / damp))
            history.append(fx)
        self.sigma = sigma
        return x, fx, history


def euclidean_one_plus_one_es(f: Callable[[np.ndarray], float], x0, budget: int, sigma0: float = 0.3,
                              manifold: str = "sphere", seed: int | None = None):
    """Baseline: the ambient (1+1)-ES (1/5 rule, D = sqrt(n + 1)); f is evaluated at points projected back.

    Returns ``(x, fx, history)`` like ``RiemannianOnePlusOneES.minimize`` (x projected onto the manifold).
    """
    rng = np.random.default_rng(seed)
    x = _check_point(x0, manifold)
    damp = math.sqrt(x.size + 1.0)
    sigma = float(sigma0)
    fx = float(f(project(x, manifold)))
    history = [fx]
    for _ in range(budget - 1):
        y = x + sigma * rng.standard_normal(x.shape)
        fy = float(f(project(y, manifold)))
        success = fy <= fx
        if success:
            x, fx = y, fy
        sigma *= math.exp(((1.0 if success else 0.0) - 0.2) / damp)
        history.append(fx)
    return project(x, manifold), fx, history


def cma_minimize(f: Callable[[np.ndarray], float], x0, budget: int, sigma0: float = 0.3,
                 manifold: str = "sphere", seed: int | None = None):
    """Baseline: CMA-ES (the ``cma`` package) on the projected objective; returns ``(x, fx, history)``."""
    import cma

    x0 = _check_point(x0, manifold)
    shape = x0.shape
    history: list[float] = []
    best = [math.inf, x0]

    def g(z):
        if len(history) >= budget:  # cma asks in generations; never spend more than the budget
            return best[0]
        p = project(np.asarray(z, dtype=float).reshape(shape), manifold)
        v = float(f(p))
        if v < best[0]:
            best[0], best[1] = v, p
        history.append(best[0])
        return v

    opts = {"maxfevals": budget, "verbose": -9, "seed": (seed or 0) + 1, "tolfun": 0, "tolx": 0,
            "tolfunhist": 0, "tolstagnation": 10**9}
    es = cma.CMAEvolutionStrategy(x0.ravel(), sigma0, opts)
    while len(history) < budget and not es.stop():
        xs = es.ask()
        es.tell(xs, [g(z) for z in xs])
    return best[1], best[0], history[:budget]


def sparse_pca_problem(n: int = 30, k: int = 5, strength: float = 3.0, lam: float = 0.05, seed: int = 0,
                       p: int = 1):
    """A sparse-PCA instance: A = sparse spike + Wishart noise (4n samples), the objective penalises ||.||_1.

    ``p = 1`` (the sphere S^{n-1}): ``f(x) = -x^T A x + lam ||x||_1``; returns ``(f, A, u1)`` with u1 the leading
    eigenvector of A (what the search should find). ``p >= 2`` (Stiefel St(n, p), the p-component version):
    ``f(X) = -tr(X^T A X) + lam ||X||_1`` with a rank-p spike whose columns are k-sparse on disjoint supports
    (k is lowered to n // p where needed) and strengths ``strength * linspace(1.5, 1, p)``; returns
    ``(f, A, U)`` with U the n x p leading eigenvectors (the subspace the search should find).
    """
    if p < 1 or p > n or k < 1 or n < 2:
        raise ValueError(f"sparse_pca_problem needs n >= 2, 1 <= p <= n and k >= 1 (got n={n}, p={p}, k={k})")
    rng = np.random.default_rng(seed)
    if p == 1:
        v = np.zeros(n)
        idx = rng.choice(n, size=min(k, n), replace=False)
        v[idx] = rng.choice([-1.0, 1.0], size=idx.size) / math.sqrt(idx.size)
        spike = strength * np.outer(v, v)
    else:
        k = min(k, n // p)
        support = rng.permutation(n)[: k * p].reshape(p, k)
        v = np.zeros((n, p))
        for j in range(p):
            v[support[j], j] = rng.choice([-1.0, 1.0], size=k) / math.sqrt(k)
        spike = strength * (v * np.linspace(1.5, 1.0, p)) @ v.T
    g = rng.standard_normal((4 * n, n))
    a = spike + g.T @ g / (4 * n)
    _, q = np.linalg.eigh(a)
    if p == 1:
        def f(x):
            return float(-x @ a @ x + lam * np.abs(x).sum())

        return f, a, q[:, -1]

    def f(x):
        return float(-np.trace(x.T @ a @ x) + lam * np.abs(x).sum())

    return f, a, q[:, -p:]


def overlap(x: np.ndarray, u: np.ndarray) -> float:
    """How well x recovers the target: ``|<x, u>|`` on the sphere, ``||U^T X||_F^2 / p`` on Stiefel (1 = found)."""
    x, u = np.asarray(x, dtype=float), np.asarray(u, dtype=float)
    if x.shape != u.shape:
        raise ValueError(f"overlap needs x and u of one shape (got {x.shape} and {u.shape})")
    if x.ndim == 1:
        return float(abs(x @ u))
    return float(np.linalg.norm(u.T @ x) ** 2 / x.shape[1])


def evaluations_to_target(run: Callable[[Callable], object], f: Callable[[np.ndarray], float],
                          score: Callable[[np.ndarray], float], target: float) -> tuple[int | None, float]:
    """Calls ``run(g)`` with g a counting wrapper of f and watches the best point evaluated so far.

    Returns ``(k, best_score)``: k the number of evaluations after which that best point first scored
    ``>= target`` (None if it never did), best_score the score of the best point at the end. Works for any
    minimizer that evaluates points on the manifold (the baselines evaluate f at projected points).
    """
    state = {"evals": 0, "best": math.inf, "score": -math.inf, "hit": None}

    def g(x):
        v = float(f(x))
        state["evals"] += 1
        if v < state["best"]:
            state["best"], state["score"] = v, float(score(x))
            if state["hit"] is None and state["score"] >= target:
                state["hit"] = state["evals"]
        return v

    run(g)
    return state["hit"], state["score"]


ES_METHODS = ("riemannian", "euclidean", "cma")


def compare_on_sparse_pca(n: int, p: int = 1, seeds: int = 8, budget: int = 2000, sigma0: float = 0.05,
                          target: float = 0.95, methods: tuple[str, ...] = ES_METHODS, k: int = 5) -> dict:
    """The sparse-PCA race with its success criterion fixed before the run.

    For each seed s: instance ``sparse_pca_problem(n, k, seed=s, p=p)``, start ``x0`` a random point of the
    manifold (seed 100 + s), the same sigma0 and budget for every method. Per method, returns
    ``{"evals": [...], "overlap": [...]}`` with evals the evaluations until the best point so far first
    reached ``overlap >= target`` (None: not within the budget) and overlap that best point's final overlap.
    Methods: "riemannian" (this module's ES), "euclidean" (``euclidean_one_plus_one_es``, the ambient ES
    projected back), "cma" (``cma_minimize``).
    """
    unknown = [m for m in methods if m not in ES_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {ES_METHODS}")
    manifold = "sphere" if p == 1 else "stiefel"
    out = {m: {"evals": [], "overlap": []} for m in methods}
    for s in range(seeds):
        f, _, u = sparse_pca_problem(n=n, k=k, seed=s, p=p)
        z = np.random.default_rng(100 + s).standard_normal(n if p == 1 else (n, p))
        x0 = project(z, manifold)
        runs = {"riemannian": lambda g, s=s, x0=x0: RiemannianOnePlusOneES(manifold, sigma0, seed=s).minimize(
                    g, x0, budget),
                "euclidean": lambda g, s=s, x0=x0: euclidean_one_plus_one_es(g, x0, budget, sigma0,
                                                                             manifold=manifold, seed=s),
                "cma": lambda g, s=s, x0=x0: cma_minimize(g, x0, budget, sigma0, manifold=manifold, seed=s)}
        for m in methods:
            hit, ov = evaluations_to_target(runs[m], f, lambda x, u=u: overlap(x, u), target)
            out[m]["evals"].append(hit)
            out[m]["overlap"].append(ov)
    return out


def summarize_evaluations(evals: list[int | None], budget: int) -> dict:
    """Success rate and the median / quartiles of evaluations-to-target, a miss counted as ``budget + 1``
    (censored: a method that misses is never credited with fewer evaluations than the budget)."""
    if not evals:
        raise ValueError("summarize_evaluations needs at least one run")
    e = np.array([budget + 1 if v is None else v for v in evals], dtype=float)
    q1, med, q3 = np.percentile(e, [25, 50, 75])
    return {"success_rate": float(np.mean([v is not None for v in evals])), "median": float(med),
            "q1": float(q1), "q3": float(q3)}


__all__ = ["ES_METHODS", "RiemannianOnePlusOneES", "cma_minimize", "compare_on_sparse_pca", "euclidean_one_plus_one_es",
           "evaluations_to_target", "intrinsic_dim", "overlap", "project", "retract", "sparse_pca_problem",
           "summarize_evaluations", "tangent_project"]
