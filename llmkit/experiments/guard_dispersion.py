"""How spread out a set of hidden states is: the measurement behind AEO's "Asymmetric Logic".

AEO ("Asymmetric Entropic Optimization" against instruction injection, NeurIPS 2026) rests on one observation: responses
that comply with the system prompt concentrate in a low-variability region of latent
space, while responses where an injection won scatter in diverse directions. This
module measures that directly, per layer, on one vector per response (the mean of its
token states: the trajectory's centroid), for two groups of responses (compliant,
violating):

- ``logdet``: the per-dimension log-determinant of a Ledoit-Wolf shrunk covariance
  (``sklearn.covariance.ledoit_wolf``), i.e. the Gaussian differential entropy per
  dimension up to a constant, ``H/d = 0.5 log(2 pi e) + 0.5 logdet(Sigma)/d``;
- ``knn``: the Kozachenko-Leonenko k-nearest-neighbour entropy estimate (nats), a
  distribution-free check on the Gaussian one;
- ``trace``: the total variance per dimension, ``tr(Sigma)/d`` (direction-free, the
  simplest and most stable of the three).

A group comparison (:func:`compare`) puts both groups in the same coordinates first
for ``logdet`` and ``knn``: a PCA basis fitted on pooled responses of both groups, with
``n_components`` kept, since with tens of responses a 576-dimensional covariance
has no determinant worth reading. Group sizes are balanced by subsampling the larger
group (``n_draws`` random draws, estimates averaged), and the basis is cross-fitted (fitted
on one half of each group, measured on the other, then swapped): see :func:`compare`. The ratio reported is the *entropy power* ratio per dimension,
``exp(2 (H_violating - H_compliant) / k)``, which for Gaussians equals the ratio of
generalised variances per dimension, so ``> 1`` means violations scatter more (the
asymmetry holds) and ``1`` means no difference. ``trace`` is measured in the full space
with a ``scipy.stats.bootstrap`` interval over responses.

Deviation: the paper does not say how it measures variability; these are three
standard estimators, reported side by side so that a conclusion does not hinge on one.
"""

from __future__ import annotations

import math

import numpy as np

ESTIMATORS = ("logdet", "trace", "knn")


def _as_2d(x, name: str = "x") -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (samples x dims), got shape {a.shape}")
    if a.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 samples to measure dispersion, got {a.shape[0]}")
    return a


def logdet_per_dim(x) -> float:
    """Per-dimension log-determinant of the Ledoit-Wolf shrunk covariance of the rows of ``x``."""
    from sklearn.covariance import ledoit_wolf

    a = _as_2d(x)
    cov, _ = ledoit_wolf(a)
    sign, logdet = np.linalg.slogdet(cov)
    if sign <= 0:
        return float("-inf")  # all rows equal: no spread at all
    return float(logdet / a.shape[1])


def gaussian_entropy(x) -> float:
    """Differential entropy (nats, total) of the Gaussian with ``x``'s shrunk covariance."""
    a = _as_2d(x)
    d = a.shape[1]
    return 0.5 * d * (math.log(2 * math.pi) + 1) + 0.5 * d * logdet_per_dim(a)


def knn_entropy(x, k: int = 3) -> float:
    """Kozachenko-Leonenko entropy estimate (nats, total) from each row's ``k``-th neighbour distance.

    ``H = psi(n) - psi(k) + log V_d + (d / n) sum_i log eps_i`` with ``V_d`` the volume of
    the unit ball and ``eps_i`` the Euclidean distance from row ``i`` to its ``k``-th
    nearest other row. Repeated rows (distance 0) make it undefined: ``ValueError``.
    """
    from scipy.spatial import cKDTree
    from scipy.special import digamma, gammaln

    a = _as_2d(x)
    n, d = a.shape
    if not 1 <= k < n:
        raise ValueError(f"k must be between 1 and n-1 = {n - 1}, got {k}")
    dist, _ = cKDTree(a).query(a, k=k + 1)  # the nearest is the row itself
    eps = dist[:, k]
    if np.any(eps <= 0):
        raise ValueError("knn_entropy: repeated rows (k-th neighbour at distance 0); the estimate is undefined")
    log_vd = (d / 2) * math.log(math.pi) - gammaln(d / 2 + 1)
    return float(digamma(n) - digamma(k) + log_vd + d * np.mean(np.log(eps)))


def trace_per_dim(x) -> float:
    """Total variance per dimension, ``tr(cov(x)) / d``."""
    a = _as_2d(x)
    return float(a.var(axis=0, ddof=1).mean())


def entropy_per_dim(x, estimator: str) -> float:
    """The group's spread as an entropy per dimension (nats), so estimators compare as entropy powers.

    ``trace`` is turned into the entropy of an isotropic Gaussian with that variance.
    """
    a = _as_2d(x)
    d = a.shape[1]
    if estimator == "logdet":
        return 0.5 * (math.log(2 * math.pi) + 1) + 0.5 * logdet_per_dim(a)
    if estimator == "trace":
        return 0.5 * (math.log(2 * math.pi) + 1) + 0.5 * math.log(max(trace_per_dim(a), 1e-300))
    if estimator == "knn":
        # a repeated row (the same prompt answered the same way twice in a dataset) leaves the k-NN estimate
        # undefined; it adds no spread, so it is measured once
        return knn_entropy(np.unique(a, axis=0)) / d
    raise ValueError(f"unknown dispersion estimator '{estimator}': choose from {', '.join(ESTIMATORS)}")


def pca_basis(x, n_components: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, components (k x d)) of the rows of ``x``; ``k`` capped by the data's rank."""
    a = _as_2d(x)
    mu = a.mean(0)
    _, _, vt = np.linalg.svd(a - mu, full_matrices=False)
    k = max(1, min(n_components, a.shape[0] - 1, a.shape[1]))
    return mu, vt[:k]


def log_ratio(violating, compliant, estimator: str) -> float:
    """``2 (H_v - H_c)`` per dimension: the log of the entropy-power ratio (same coordinates assumed)."""
    return 2.0 * (entropy_per_dim(violating, estimator) - entropy_per_dim(compliant, estimator))


def compare(compliant, violating, *, n_components: int = 8, estimators=ESTIMATORS, n_draws: int = 20,
            n_resamples: int = 400, seed: int = 0) -> dict:
    """Dispersion of violating vs compliant responses (rows = one vector per response).

    Returns ``{"n_compliant", "n_violating", "n_balanced", "components", estimator: {"ratio",
    "log_ratio", "ci_low", "ci_high", "draw_sd"}}`` where ``ratio = exp(log_ratio)`` is the
    violating / compliant entropy power per dimension (``> 1``: violations scatter more).

    - ``trace`` is computed in the full space (it needs no basis and does not depend on the
      group sizes), with a ``scipy.stats.bootstrap`` percentile interval over responses.
    - ``logdet`` and ``knn`` need a low-dimensional basis. A basis fitted on the very rows it
      then measures makes them look spread (the top principal directions are where those rows
      vary most), which favours whichever group has fewer rows. So each draw subsamples both
      groups to the smaller size, splits each in halves, fits the pooled PCA basis on one half
      of each group and measures the other halves in it, then swaps (cross-fitting); the
      estimate is the mean over ``n_draws`` draws and ``draw_sd`` their spread (no bootstrap
      interval: a resample's repeated rows would sit on both sides of the split).
    """
    from scipy.stats import bootstrap

    c, v = _as_2d(compliant, "compliant"), _as_2d(violating, "violating")
    if c.shape[1] != v.shape[1]:
        raise ValueError(f"compliant and violating states differ in width: {c.shape[1]} vs {v.shape[1]}")
    bad = [e for e in estimators if e not in ESTIMATORS]
    if bad:
        raise ValueError(f"unknown dispersion estimator(s) {bad}: choose from {', '.join(ESTIMATORS)}")
    n = min(len(c), len(v))
    if n < 6:
        raise ValueError(f"need at least 6 responses in each group, got {len(c)} compliant, {len(v)} violating")
    rng = np.random.default_rng(seed)
    half = n // 2
    k = max(1, min(n_components, half - 2))
    out: dict = {"n_compliant": len(c), "n_violating": len(v), "n_balanced": n, "components": k}
    for est in estimators:
        if est == "trace":
            lr = log_ratio(v, c, "trace")
            row = {"log_ratio": lr, "ratio": math.exp(lr), "ci_low": float("nan"), "ci_high": float("nan"),
                   "draw_sd": 0.0}
            if n_resamples:

                def stat(vi, ci):  # scipy resamples 1-D samples: resample row indices
                    return log_ratio(v[vi.astype(int)], c[ci.astype(int)], "trace")

                res = bootstrap((np.arange(len(v)), np.arange(len(c))), stat, vectorized=False, paired=False,
                                n_resamples=n_resamples, method="percentile",
                                random_state=np.random.default_rng(seed + 1))
                row["ci_low"] = math.exp(float(res.confidence_interval.low))
                row["ci_high"] = math.exp(float(res.confidence_interval.high))
            out[est] = row
            continue
        draws = []
        for _ in range(n_draws):
            ci = c[rng.choice(len(c), n, replace=False)]
            vi = v[rng.choice(len(v), n, replace=False)]
            parts = []
            for a, b in ((slice(0, half), slice(half, n)), (slice(half, n), slice(0, half))):
                mu, comps = pca_basis(np.concatenate([ci[a], vi[a]]), k)
                parts.append(log_ratio((vi[b] - mu) @ comps.T, (ci[b] - mu) @ comps.T, est))
            draws.append(float(np.mean(parts)))
        lr = float(np.mean(draws))
        out[est] = {"log_ratio": lr, "ratio": math.exp(lr), "ci_low": float("nan"), "ci_high": float("nan"),
                    "draw_sd": float(np.std(draws))}
    return out
