"""Statistics for evaluating the AEO guard: splits, AUROC with intervals, per-layer dispersion, arm intervals.

Used by ``bench/guard.py``; kept here so that it is tested. Intervals come from
``scipy.stats.bootstrap`` (percentile method) and AUROC from
``sklearn.metrics.roc_auc_score``:

- :func:`auroc_ci` resamples violations and compliant answers separately (a stratified
  bootstrap: every resample keeps both classes, so the AUROC is always defined);
- :func:`aggregate_ci` resamples answers (rows) and recomputes any aggregate of them (IHEval's
  benchmark averaging, say), optionally as a paired difference against a baseline arm that
  shares the rows;
- :func:`split` assigns an item to fit / validation / test by a hash of its key, so the
  same underlying prompt (say, one IHEval id in its aligned and conflict forms) never
  lands on two sides;
- :func:`dispersion_by_layer` runs :func:`llmkit.serving.guard.dispersion.compare` on
  response centroids layer by layer, optionally after removing each group-of-origin's
  (task's) mean, so that a difference in task mix between compliant and violating answers
  is not read as a difference in spread.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np


def split(key: str, fractions=(0.4, 0.2, 0.4), names=("fit", "val", "test")) -> str:
    """The part ``key`` belongs to, by a stable hash (same key, same part, on every machine)."""
    if len(fractions) != len(names) or any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions {fractions} must be non-negative, one per part {names}, and sum to 1")
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    acc = 0.0
    for f, name in zip(fractions, names):
        acc += f
        if u < acc:
            return name
    return names[-1]


def auroc(scores, labels) -> float:
    """``sklearn.metrics.roc_auc_score`` (labels 1 = violation); NaN when a class is missing."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=int)
    if y.min(initial=1) == y.max(initial=0):
        return float("nan")
    return float(roc_auc_score(y, np.asarray(scores, dtype=float)))


def auroc_ci(scores, labels, *, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict:
    """``{"auroc", "low", "high", "n_pos", "n_neg"}``: AUROC and a stratified bootstrap interval."""
    from scipy.stats import bootstrap

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

    res = bootstrap((pos, neg), stat, vectorized=False, paired=False, n_resamples=n_resamples,
                    confidence_level=confidence, method="percentile", random_state=np.random.default_rng(seed))
    out["low"], out["high"] = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return out


def aggregate_ci(n_rows: int, statistic, *, baseline=None, n_resamples: int = 1000, confidence: float = 0.95,
                 seed: int = 0) -> dict:
    """Bootstrap interval of ``statistic(rows)`` over resampled row indices.

    ``statistic(idx)`` gets an integer index array (with repeats) and returns a number;
    with ``baseline`` (same signature, same rows) the interval is for the paired difference
    ``statistic(idx) - baseline(idx)``. Returns ``{"value", "low", "high"}`` (value on all rows).
    """
    from scipy.stats import bootstrap

    if n_rows < 2:
        raise ValueError(f"need at least 2 rows for a bootstrap interval, got {n_rows}")

    def stat(idx):
        i = idx.astype(int)
        return statistic(i) - (baseline(i) if baseline is not None else 0.0)

    all_idx = np.arange(n_rows)
    value = float(stat(all_idx))
    res = bootstrap((all_idx,), stat, vectorized=False, n_resamples=n_resamples, confidence_level=confidence,
                    method="percentile", random_state=np.random.default_rng(seed))
    return {"value": value, "low": float(res.confidence_interval.low), "high": float(res.confidence_interval.high)}


def realized_fpr(scores, threshold: float) -> float:
    """Fraction of (compliant) ``scores`` strictly above ``threshold``."""
    s = np.asarray(scores, dtype=float)
    if s.size == 0:
        raise ValueError("no compliant scores to measure the false-positive rate on")
    return float((s > threshold).mean())


def dispersion_by_layer(centroids: dict[int, np.ndarray], labels, groups=None, **compare_kw) -> dict[int, dict]:
    """Per layer, :func:`~llmkit.serving.guard.dispersion.compare` of label-1 vs label-0 rows.

    ``centroids``: layer -> (n, d) array (one row per response); ``labels``: 0 compliant,
    1 violating, ``None`` left out; ``groups`` (optional, one key per row): each group's mean
    over its labelled rows is subtracted first (between-group offsets removed).
    """
    from llmkit.serving.guard.dispersion import compare

    keep = [i for i, y in enumerate(labels) if y is not None]
    y = np.asarray([labels[i] for i in keep], dtype=int)
    out = {}
    for layer, x in centroids.items():
        a = np.asarray(x, dtype=np.float64)[keep]
        if groups is not None:
            g = np.asarray([groups[i] for i in keep])
            a = a.copy()
            for key in set(g.tolist()):
                a[g == key] -= a[g == key].mean(0)
        out[layer] = compare(a[y == 0], a[y == 1], **compare_kw)
    return out


def cross_validated_auroc(caps: list, labels, keys, *, kinds=("energy", "entropic"), n_folds: int = 5,
                          calibration: float = 0.3, seed: int = 0, **fit_kw) -> dict[str, float]:
    """Pooled out-of-fold AUROC of each chaos score kind, to choose the default on held-out data.

    Items are put in ``n_folds`` folds by a hash of ``keys`` (one key per capture: an item's
    variants stay together). For each fold, a guard of each kind is fitted on the *compliant*
    captures of the other folds (``calibration`` of them for the score's calibration) and
    scores the fold; the AUROC is computed once over all out-of-fold scores (labels 1 =
    violation, ``None`` left out). ``fit_kw`` goes to ``Guard.fit_captures`` (model_name,
    hidden_size, num_layers, n_components, ...).
    """
    from llmkit.serving.guard.guard import Guard

    if not len(caps) == len(labels) == len(keys):
        raise ValueError(f"caps, labels and keys differ in length: {len(caps)}, {len(labels)}, {len(keys)}")
    names = tuple(str(f) for f in range(n_folds))
    fold = [split(f"cv{seed}/{k}", (1.0 / n_folds,) * n_folds, names) for k in keys]
    rng = np.random.default_rng(seed)
    out_scores: dict[str, list[float]] = {k: [] for k in kinds}
    out_labels: list[int] = []
    for f in names:
        held = [i for i in range(len(caps)) if fold[i] == f and labels[i] is not None]
        train_ok = [i for i in range(len(caps)) if fold[i] != f and labels[i] == 0]
        if not held or len(train_ok) < 4:
            continue
        train_ok = [train_ok[j] for j in rng.permutation(len(train_ok))]
        n_cal = max(2, int(calibration * len(train_ok)))
        for kind in kinds:
            g = Guard.fit_captures([caps[i] for i in train_ok[n_cal:]], [caps[i] for i in train_ok[:n_cal]],
                                   score=kind, **fit_kw)
            out_scores[kind] += g.score_captures([caps[i] for i in held]).tolist()
        out_labels += [labels[i] for i in held]
    return {kind: auroc(out_scores[kind], out_labels) for kind in kinds}
