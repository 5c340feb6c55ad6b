"""TC-DRO: target-conditional distributionally robust example weights, with Wasserstein and chi-square baselines.

Paper: "target-conditional distributionally robust optimization" (NeurIPS 2026). With
imbalanced regression targets, one ambiguity set of one radius puts its adversarial mass on the dense part of
the data, so rare target ranges stay unprotected. TC-DRO defines the ambiguity set per target region, with
radii that grow where data are scarce; its dual is a weighted empirical risk with density-adaptive weights.

How the weights are formed here (``tc_dro_weights``):

1. **Regions** are ``num_regions`` equal-width ranges of the target value between its minimum and maximum
   (``target_regions``); empty ranges are dropped. Equal width, not equal count: quantile regions would hold
   the same number of examples each and hide exactly the imbalance the method is about.
2. **Radii grow where data are scarce**: region k with n_k examples gets ``rho_k = radius * nbar / n_k``
   (``nbar`` the mean count over non-empty regions), the 1/n_k rate at which a chi-square divergence
   between an empirical and a true distribution shrinks; a region of average size gets ``radius``.
3. **Dual as weighted empirical risk.** Within region k the worst case over the chi-square ball
   ``{Q_k : chi2(Q_k || P_k) <= rho_k}`` is attained by the weights ``p_i ~ (loss_i - eta)_+`` (exact, eta
   by bisection, ``chi2_worst_case_weights``), which tilt towards the region's hard examples. Region k's
   mass is the upper end of its own chi-square ball, ``pi_k (1 + sqrt(2 rho_k))``, so scarce regions carry
   a larger mean weight. Weights are rescaled to sum to n.

Baselines: ``chi2_dro_weights`` (one chi-square ball over all examples: the same worst case with a single
radius), ``wasserstein_dro_weights`` (a transport ball moves points instead of reweighting them, so its
example weights are uniform: the paper's "Wasserstein DRO collapses to ERM under uniform weights"; the
robustness lives in a norm penalty, ``wasserstein_dro_linear`` for linear least squares).

Training with losses that depend on the weights alternates: fit, recompute the losses, recompute the weights
(the best response of the adversary), refit (``fit_weighted_linear``); weights are averaged over rounds to
damp oscillation.

Deviations: the abstract states neither the region rule nor the weight formula; the above is our reading
(regions by target range, chi-square balls, 1/n_k radii, mass at the edge of the ball). Everything is
numpy; a training job passes the weights as per-example loss weights (e.g. ``sample_weight``).

Whether the weights help is measured, not assumed: ``bench/optim_structured.py`` compares them with ERM and
global chi-square DRO on an imbalanced toy, scikit-learn's diabetes data and the GSM8K difficulty regressor
(``llmkit.train.difficulty``); results in bench/results/optim_structured.md. Treat them as one option to
measure, not a default.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = [
    "chi2_dro_weights",
    "chi2_worst_case_weights",
    "fit_weighted_linear",
    "imbalanced_regression_toy",
    "tail_mask",
    "target_regions",
    "tc_dro_weights",
    "wasserstein_dro_linear",
    "wasserstein_dro_weights",
]


def _vec(x, name) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return a


def target_regions(targets, num_regions: int = 10) -> np.ndarray:
    """Region index (0..K-1, only non-empty regions, in target order) of each example: equal-width target ranges."""
    y = _vec(targets, "targets")
    if num_regions < 1:
        raise ValueError("num_regions must be >= 1")
    lo, hi = y.min(initial=0.0), y.max(initial=0.0)
    if hi <= lo:
        return np.zeros(len(y), dtype=int)
    edges = np.linspace(lo, hi, num_regions + 1)
    raw = np.clip(np.searchsorted(edges, y, side="right") - 1, 0, num_regions - 1)
    _, idx = np.unique(raw, return_inverse=True)
    return idx.reshape(-1)


def chi2_worst_case_weights(losses, radius: float) -> np.ndarray:
    """n * p*, where p* maximises sum p_i loss_i over the simplex with (1/n) sum (n p_i - 1)^2 / 2 <= radius."""
    ell = _vec(losses, "losses")
    n = len(ell)
    if n == 0:
        return ell
    if radius <= 0 or np.ptp(ell) == 0:
        return np.ones(n)

    def weights(eta):
        w = np.maximum(ell - eta, 0.0)
        return n * w / w.sum()

    def div(eta):
        return 0.5 * np.mean((weights(eta) - 1.0) ** 2)

    hi = ell.max() - 1e-12 * (1 + abs(ell.max()))
    if div(hi) <= radius:                # the ball holds every reachable tilt: put mass on the largest losses
        return weights(hi)
    spread = ell.max() - ell.min()
    lo = ell.min() - spread
    while div(lo) > radius:
        lo -= 10 * spread
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if div(mid) > radius:
            hi = mid
        else:
            lo = mid
    return weights(lo)


def tc_dro_weights(targets, losses, num_regions: int = 10, radius: float = 0.1) -> np.ndarray:
    """TC-DRO example weights (non-negative, summing to n); see the module docstring for the construction."""
    y = _vec(targets, "targets")
    ell = _vec(losses, "losses")
    if len(y) != len(ell):
        raise ValueError(f"targets ({len(y)}) and losses ({len(ell)}) differ in length")
    if radius < 0:
        raise ValueError("radius must be >= 0")
    n = len(y)
    if n == 0:
        return ell
    region = target_regions(y, num_regions)
    K = region.max() + 1
    counts = np.bincount(region, minlength=K)
    nbar = n / K
    w = np.empty(n)
    for k in range(K):
        members = region == k
        rho = radius * nbar / counts[k]
        w[members] = (1.0 + np.sqrt(2.0 * rho)) * chi2_worst_case_weights(ell[members], rho)
    return w * (n / w.sum())


def chi2_dro_weights(losses, radius: float = 0.1) -> np.ndarray:
    """Global chi-square DRO baseline: one ball of one radius over all examples."""
    return chi2_worst_case_weights(losses, radius)


def wasserstein_dro_weights(losses, radius: float = 0.1) -> np.ndarray:
    """Wasserstein DRO baseline as example weights: uniform (the adversary transports points, it does not
    reweight them); use ``wasserstein_dro_linear`` for the penalty that carries its robustness."""
    return np.ones(len(_vec(losses, "losses")))


def wasserstein_dro_linear(X, y, radius: float = 0.1) -> np.ndarray:
    """Linear least squares under a type-2 Wasserstein ball on the features (Blanchet-Kang-Murthy): minimise
    ``(sqrt(mean residual^2) + sqrt(radius) * ||beta||)^2``. Returns [intercept, beta...]."""
    from scipy.optimize import minimize

    X = np.asarray(X, dtype=np.float64)
    y = _vec(y, "y")
    Z = np.hstack([np.ones((len(X), 1)), X])
    start = np.linalg.lstsq(Z, y, rcond=None)[0]

    def obj(b):
        res = Z @ b - y
        return (np.sqrt(np.mean(res ** 2) + 1e-12) + np.sqrt(radius) * np.sqrt(b[1:] @ b[1:] + 1e-12)) ** 2

    return minimize(obj, start, method="L-BFGS-B").x


def fit_weighted_linear(X, y, weight_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None, *,
                        rounds: int = 10, ridge: float = 1e-6) -> np.ndarray:
    """Weighted least squares with weights re-computed from the current squared errors:
    ``weight_fn(targets, losses) -> weights`` (None: ERM). Returns [intercept, beta...]."""
    X = np.asarray(X, dtype=np.float64)
    y = _vec(y, "y")
    Z = np.hstack([np.ones((len(X), 1)), X])
    reg = ridge * np.eye(Z.shape[1])
    reg[0, 0] = 0.0

    def solve(w):
        Zw = Z * w[:, None]
        return np.linalg.solve(Z.T @ Zw + reg * len(y), Zw.T @ y)

    w = np.ones(len(y))
    beta = solve(w)
    if weight_fn is None:
        return beta
    avg = np.zeros(len(y))
    for t in range(rounds):
        new = np.asarray(weight_fn(y, (Z @ beta - y) ** 2), dtype=np.float64)
        avg = avg + (new - avg) / (t + 1)
        beta = solve(avg)
    return beta


def tail_mask(train_targets, targets, fraction: float = 0.1) -> np.ndarray:
    """Examples whose target falls in the rarest ``fraction`` of the training target range: the equal-width
    regions (20 of them) with the fewest training examples, filled rarest-first until they hold ``fraction``
    of the training data."""
    ytr = _vec(train_targets, "train_targets")
    y = _vec(targets, "targets")
    edges = np.linspace(ytr.min(), ytr.max(), 21)
    counts = np.histogram(ytr, edges)[0]
    chosen, total = [], 0
    for k in np.argsort(counts, kind="stable"):
        if total >= fraction * len(ytr):
            break
        chosen.append(k)
        total += counts[k]
    bins = np.clip(np.searchsorted(edges, y, side="right") - 1, 0, 19)
    outside = (y < edges[0]) | (y > edges[-1])
    return np.isin(bins, chosen) | outside


def imbalanced_regression_toy(n: int = 2000, dim: int = 5, seed: int = 0):
    """(X, y) with a skewed target: most examples sit in a noisy bulk, a thin right tail is nearly noise-free
    but curved, so a linear fit trades the tail away for the bulk."""
    rng = np.random.default_rng(seed)
    beta = np.linspace(1.0, 0.2, dim)
    beta /= np.linalg.norm(beta)
    X = rng.normal(size=(n, dim))
    X[:, 0] = rng.exponential(1.0, n)                   # skewed driver
    z = X @ beta
    noise = np.where(z < 1.5, 1.0, 0.1) * rng.normal(size=n)
    y = z + 0.35 * np.maximum(z - 1.5, 0.0) ** 2 + noise
    return X, y
