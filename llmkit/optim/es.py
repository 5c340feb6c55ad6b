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

Deviation from the paper: its analysis uses a fixed step ``sigma0``; here sigma adapts by the 1/5 rule
by default (``adapt=False`` gives the fixed-step method), which is what makes the method practical under
a small budget. R is an absolute radius that keeps each step inside a ball where the retraction is a good
chart (default pi/4 on the sphere, 0.5 on Stiefel).

Baselines: ``euclidean_one_plus_one_es`` (the ambient (1+1)-ES with the same 1/5 rule, iterating in R^n
and evaluating f at the projection of its points back onto the manifold; its answer is projected too) and
``cma_minimize`` (``cma``'s CMA-ES on the same projected objective).
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
                 *, adapt: bool = True, seed: int | None = None):
        if manifold not in ("sphere", "stiefel"):
            raise ValueError(f"manifold must be 'sphere' or 'stiefel' (got {manifold!r})")
        if sigma0 <= 0:
            raise ValueError("sigma0 must be > 0")
        self.manifold = manifold
        self.sigma0 = float(sigma0)
        self.truncation_radius = float(truncation_radius if truncation_radius is not None
                                       else (math.pi / 4 if manifold == "sphere" else 0.5))
        self.adapt = adapt
        self.rng = np.random.default_rng(seed)
        self.sigma = self.sigma0

    def minimize(self, f: Callable[[np.ndarray], float], x0, budget: int):
        x = _check_point(x0, self.manifold)
        if budget < 1:
            raise ValueError("budget must be >= 1")
        d = intrinsic_dim(x.shape, self.manifold)
        damp = math.sqrt(d + 1.0)
        sigma = self.sigma0
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
                sigma *= math.exp(((1.0 if success else 0.0) - 0.2) / damp)
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


def sparse_pca_problem(n: int = 30, k: int = 5, strength: float = 3.0, lam: float = 0.05, seed: int = 0):
    """A sparse-PCA instance on the sphere: ``f(x) = -x^T A x + lam ||x||_1``, A = spike + Wishart noise.

    Returns ``(f, A, u1)`` with u1 the leading eigenvector of A (what the search should find).
    """
    rng = np.random.default_rng(seed)
    v = np.zeros(n)
    idx = rng.choice(n, size=k, replace=False)
    v[idx] = rng.choice([-1.0, 1.0], size=k) / math.sqrt(k)
    g = rng.standard_normal((4 * n, n))
    a = strength * np.outer(v, v) + g.T @ g / (4 * n)
    w, q = np.linalg.eigh(a)
    u1 = q[:, -1]

    def f(x):
        return float(-x @ a @ x + lam * np.abs(x).sum())

    return f, a, u1


__all__ = ["RiemannianOnePlusOneES", "cma_minimize", "euclidean_one_plus_one_es", "intrinsic_dim", "project",
           "retract", "sparse_pca_problem", "tangent_project"]
