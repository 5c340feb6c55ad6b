"""Statistics helpers shared by the benches, on ``scipy.stats`` and ``sklearn.metrics``: one place for
intervals over seeds, paired differences, proportions, AUROC and bootstrap intervals over rows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats


def mean_ci(values: Sequence[float], level: float = 0.95) -> dict:
    """``{mean, lo, hi, std, n}``: the mean of ``values`` with its Student-t interval (lo = hi = mean for n = 1).

    The t interval, not a bootstrap: the benches that call this average a handful to a few dozen independent
    draws (seeds), where a percentile bootstrap is too narrow.
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_ci needs at least one value")
    n = len(xs)
    m = statistics.fmean(xs)
    if n == 1:
        return {"mean": m, "lo": m, "hi": m, "std": 0.0, "n": 1}
    sd = statistics.stdev(xs)  # exact arithmetic: equal values give 0, not a rounding residue
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": m, "lo": m - half, "hi": m + half, "std": sd, "n": n}


def paired_diff(a: dict, b: dict, level: float = 0.95) -> dict:
    """``a - b`` over the keys (seeds, problems) both hold: ``mean_ci`` of the differences plus ``keys``,
    ``diffs`` and ``a_lower`` (how many differences are negative). ``ValueError`` without a shared key."""
    keys = sorted(set(a) & set(b), key=str)
    if not keys:
        raise ValueError(f"no key in both: {sorted(a, key=str)} vs {sorted(b, key=str)}")
    diffs = [float(a[k]) - float(b[k]) for k in keys]
    return mean_ci(diffs, level) | {"keys": keys, "diffs": diffs, "a_lower": sum(d < 0 for d in diffs)}


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    if n <= 0:
        raise ValueError("a proportion needs n >= 1 trials")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def proportion_ci(successes: int, n: int, level: float = 0.95) -> dict:
    """``{rate, lo, hi, k, n}`` with the Wilson interval."""
    lo, hi = wilson(successes, n, level)
    return {"rate": successes / n, "lo": lo, "hi": hi, "k": int(successes), "n": int(n)}


def auroc(scores, labels) -> float:
    """``sklearn.metrics.roc_auc_score`` (label 1 = positive); NaN when a class is missing."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=int)
    if y.min(initial=1) == y.max(initial=0):
        return float("nan")
    return float(roc_auc_score(y, np.asarray(scores, dtype=float)))


def auroc_ci(scores, labels, *, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict:
    """``{"auroc", "low", "high", "n_pos", "n_neg"}``: AUROC and a stratified bootstrap interval."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=int)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape} vs {y.shape}")
    pos, neg = s[y == 1], s[y == 0]
    out = {"auroc": auroc(s, y), "low": float("nan"), "high": float("nan"), "n_pos": len(pos), "n_neg": len(neg)}
    if len(pos) < 2 or len(neg) < 2 or not n_resamples:
        return out

    def stat(p, n):
        return auroc(np.concatenate([p, n]), np.r_[np.ones(len(p)), np.zeros(len(n))])

    res = stats.bootstrap((pos, neg), stat, vectorized=False, paired=False, n_resamples=n_resamples,
                          confidence_level=confidence, method="percentile",
                          random_state=np.random.default_rng(seed))
    out["low"], out["high"] = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return out


def bootstrap_ci(n_rows: int, statistic: Callable, *, baseline: Callable | None = None, n_resamples: int = 1000,
                 confidence: float = 0.95, seed: int = 0) -> dict:
    """Bootstrap interval of ``statistic(idx)`` over resampled row indices ``idx`` (integer array, repeats).

    With ``baseline`` (same signature, same rows) the interval is for the paired difference
    ``statistic(idx) - baseline(idx)``. Returns ``{"value", "low", "high"}`` (value on all rows).
    """
    if n_rows < 2:
        raise ValueError(f"need at least 2 rows for a bootstrap interval, got {n_rows}")

    def stat(idx):
        i = idx.astype(int)
        return statistic(i) - (baseline(i) if baseline is not None else 0.0)

    all_idx = np.arange(n_rows)
    value = float(stat(all_idx))
    res = stats.bootstrap((all_idx,), stat, vectorized=False, n_resamples=n_resamples, confidence_level=confidence,
                          method="percentile", random_state=np.random.default_rng(seed))
    return {"value": value, "low": float(res.confidence_interval.low), "high": float(res.confidence_interval.high)}
