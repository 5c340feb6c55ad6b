"""Statistics helpers shared by the benches, on scipy: one place for intervals over seeds and samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    m = math.fsum(xs) / n
    if n == 1:
        return {"mean": m, "lo": m, "hi": m, "std": 0.0, "n": 1}
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": m, "lo": m - half, "hi": m + half, "std": sd, "n": n}
