"""Few-evaluation selection: fixed-confidence best-arm identification and noisy 1-D minimizer localization.

Two NeurIPS 2026 papers, two tools:

**Top-two best-arm identification** (seed: "Top-two algorithms ... fixed-confidence best-arm
identification ... Bernoulli bandits through beta-EB-TCI, the empirical-best top-two rule of Jourdan
et al. (2022), whose challenger is chosen using a Bernoulli transportation cost with a logarithmic
count penalty"). ``TopTwoEBTCI`` runs, at each step t:

- leader ``B`` = the empirical best arm (ties: the arm with fewer pulls, then the lower index);
- challenger ``C = argmin_{j != B} W(B, j) + log N_j`` with the Bernoulli transportation cost
  ``W(B, j) = N_B kl(mu_B, m) + N_j kl(mu_j, m)``, ``m = (N_B mu_B + N_j mu_j) / (N_B + N_j)``, when
  ``mu_B > mu_j`` (else 0);
- pull ``B`` with "probability" beta, by Jourdan et al.'s per-leader tracking (deterministic given the
  rewards; ``tracking=False`` flips a beta-coin); ``forced_exploration=True`` first pulls an arm with fewer
  than ``sqrt(t / K)`` pulls (the paper's mild rule);
- stop when the GLR statistic ``min_{j != B} W(B, j)`` exceeds, for every challenger j,
  ``c(N_B, N_j, delta) = 2 C_G(log((K - 1) / delta) / 2) + 2 log(4 + log N_B) + 2 log(4 + log N_j)``,
  and recommend B.

The threshold is Kaufmann & Koolen's (2021, "Mixture martingales revisited", Thm. 7) with a union bound
over the K - 1 pairs (B, a*), as in Jourdan et al. (2022) (we keep the per-arm log-log terms, which are
smaller than their ``4 log(4 + log(t/2))``); ``C_G(x) ~ x + log x`` is computed by its minimisation over
lambda in (1/2, 1]. It is delta-correct: stopping on B != a* needs ``W(B, a*) > c``, and ``W(B, a*)`` is at
most ``N_B kl(mu_hat_B, mu_B) + N_a* kl(mu_hat_a*, mu_a*)``, which exceeds c with probability <= delta / (K - 1).
``UniformAllocation`` is the baseline (round-robin, same stopping rule); ``identify_best(sample_fn,
num_arms, delta)`` returns ``(arm, samples)``; ``characteristic_time(mu, beta)`` gives ``T*_beta(mu)`` to
compare stopping times with the sharp rate ``T*_beta(mu) log(1/delta)``.

**Noisy 1-D convex minimizer localization** (seed: "one-dimensional stochastic bandit convex
optimization ... minimizer localization ... a bisection-style algorithm" matching the
``Delta_eps(f)^-2`` lower bound up to logs). ``localize_minimizer(f, lo, hi, eps, delta)`` keeps an
interval ``[a, b]`` holding the minimizer with probability >= 1 - delta and shrinks it to length <= 2 eps.
Each round samples ``x_l < x_c < x_r`` at 1/4, 1/2, 3/4 of ``[a, b]`` (near the end, ``x_l`` and ``x_r`` sit
only ``L - 2 eps`` inside the ends, so one cut finishes) in lockstep, with anytime sub-Gaussian confidence
bounds on the pairwise differences (union over sample counts and over the three pairs of each round), until
convexity turns a certain comparison into a cut: ``f(x_l) > f(x_c)`` or ``f(x_l) > f(x_r)`` gives
``a = x_l``; ``f(x_r) > f(x_c)`` or ``f(x_r) > f(x_l)`` gives ``b = x_r``. Deviation from the paper: samples
are not reused across rounds (the three points move), which costs a constant factor, not the rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

_CLIP = 1e-12


# ---------------------------------------------------------------------------------------------
# Bernoulli helpers and the stopping threshold
# ---------------------------------------------------------------------------------------------
def kl_bernoulli(p, q):
    """KL(Bernoulli(p) || Bernoulli(q)), elementwise, with p and q clipped away from 0 and 1."""
    p = np.clip(np.asarray(p, dtype=float), _CLIP, 1 - _CLIP)
    q = np.clip(np.asarray(q, dtype=float), _CLIP, 1 - _CLIP)
    return p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))


def _kl(p: float, q: float) -> float:
    p = min(max(p, _CLIP), 1 - _CLIP)
    q = min(max(q, _CLIP), 1 - _CLIP)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _g_G(lam: float) -> float:
    from scipy.special import zeta

    return 2 * lam - 2 * lam * math.log(4 * lam) + math.log(zeta(2 * lam)) - 0.5 * math.log(1 - lam)


def C_G(x: float) -> float:
    """Kaufmann & Koolen's calibration function ``min_{l in (1/2, 1)} (g_G(l) + x) / l`` (about x + log x)."""
    from scipy.optimize import minimize_scalar

    grid = np.linspace(0.5 + 1e-6, 1 - 1e-9, 4001)
    vals = np.array([(_g_G(float(l)) + x) / l for l in grid])
    i = int(np.argmin(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    r = minimize_scalar(lambda l: (_g_G(l) + x) / l, bounds=(lo, hi), method="bounded",
                        options={"xatol": 1e-10})
    return float(min(vals[i], r.fun))


def transportation_cost(mean_b: float, n_b: float, mean_j, n_j):
    """GLR statistic ``W(b, j)`` for Bernoulli arms (0 where mean_j >= mean_b); vectorized over j."""
    mean_j = np.asarray(mean_j, dtype=float)
    n_j = np.asarray(n_j, dtype=float)
    m = (n_b * mean_b + n_j * mean_j) / np.maximum(n_b + n_j, 1e-300)
    w = n_b * kl_bernoulli(mean_b, m) + n_j * kl_bernoulli(mean_j, m)
    return np.where(mean_j < mean_b, w, 0.0)


def characteristic_time(mu, beta: float = 0.5) -> float:
    """``T*_beta(mu)`` for Bernoulli means with a unique best arm (the best arm gets fraction beta).

    ``1 / T*_beta = max_{w : w_best = beta} min_{j} beta kl(mu*, m_j) + w_j kl(mu_j, m_j)``; the optimum
    equalizes the challengers' costs, found here by bisection on the common value.
    """
    from scipy.optimize import brentq

    mu = np.asarray(mu, dtype=float)
    best = int(np.argmax(mu))
    if np.sum(mu == mu[best]) > 1:
        raise ValueError("characteristic_time needs a unique best arm")
    others = np.delete(mu, best)
    top = mu[best]

    def cost(w, mj):
        m = (beta * top + w * mj) / (beta + w)
        return float(beta * kl_bernoulli(top, m) + w * kl_bernoulli(mj, m))

    def weight(c, mj):  # the w with cost(w, mj) = c (cost is increasing in w, bounded by beta kl(top, mj))
        hi = 1.0
        while cost(hi, mj) < c:
            hi *= 2.0
            if hi > 1e12:
                return math.inf
        return brentq(lambda w: cost(w, mj) - c, 0.0, hi, xtol=1e-14)

    c_max = min(beta * float(kl_bernoulli(top, mj)) for mj in others)
    c_star = brentq(lambda c: sum(weight(c, mj) for mj in others) - (1 - beta), 1e-15, c_max * (1 - 1e-12),
                    xtol=1e-15)
    return 1.0 / c_star


# ---------------------------------------------------------------------------------------------
# Best-arm identification
# ---------------------------------------------------------------------------------------------
class _GLRBestArm:
    """Shared state, statistics and the GLR stopping rule; subclasses choose ``next_arm``.

    The per-step work is plain Python on K floats (numpy's per-call overhead dominates for small K).
    """

    def __init__(self, num_arms: int, delta: float):
        if num_arms < 2:
            raise ValueError(f"num_arms must be >= 2 (got {num_arms})")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must be in (0, 1) (got {delta})")
        self.num_arms = int(num_arms)
        self.delta = float(delta)
        self._n = [0] * self.num_arms
        self._s = [0.0] * self.num_arms
        self.t = 0
        self._c0 = 2.0 * C_G(0.5 * math.log((self.num_arms - 1) / self.delta))

    @property
    def counts(self) -> np.ndarray:
        """Pulls per arm."""
        return np.array(self._n, dtype=np.int64)

    @property
    def means(self) -> np.ndarray:
        return np.array([s / n if n else 0.0 for s, n in zip(self._s, self._n)])

    def _mean(self, i: int) -> float:
        return self._s[i] / self._n[i] if self._n[i] else 0.0

    def update(self, arm: int, reward: float) -> None:
        reward = float(reward)
        if not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1] (got {reward})")
        self._n[arm] += 1
        self._s[arm] += reward
        self.t += 1

    def best_arm(self) -> int:
        """The empirical best arm (ties: fewer pulls first, then the lower index)."""
        return max(range(self.num_arms), key=lambda i: (self._mean(i), -self._n[i], -i))

    def threshold(self, n_b, n_j):
        """The pairwise GLR threshold ``c(N_b, N_j, delta)`` (module docstring)."""
        return (self._c0 + 2.0 * np.log(4.0 + np.log(np.maximum(n_b, 1)))
                + 2.0 * np.log(4.0 + np.log(np.maximum(n_j, 1))))

    def _w(self, b: int, j: int) -> float:
        """Transportation cost W(b, j) on Python floats."""
        mb, mj = self._mean(b), self._mean(j)
        if mj >= mb:
            return 0.0
        nb, nj = self._n[b], self._n[j]
        m = (nb * mb + nj * mj) / (nb + nj)
        return nb * _kl(mb, m) + nj * _kl(mj, m)

    def glr_margins(self) -> np.ndarray:
        """``W(B, j) - c(N_B, N_j)`` for every arm j (+inf at B); the rule stops when all are > 0."""
        b = self.best_arm()
        out = np.full(self.num_arms, np.inf)
        for j in range(self.num_arms):
            if j != b:
                out[j] = self._w(b, j) - float(self.threshold(self._n[b], self._n[j]))
        return out

    def should_stop(self) -> bool:
        if 0 in self._n:
            return False
        b = self.best_arm()
        cb = self._c0 + 2.0 * math.log(4.0 + math.log(self._n[b]))
        for j in range(self.num_arms):
            if j != b and self._w(b, j) <= cb + 2.0 * math.log(4.0 + math.log(self._n[j])):
                return False
        return True

    def next_arm(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class UniformAllocation(_GLRBestArm):
    """Baseline: round-robin sampling (the least-pulled arm) with the same GLR stopping rule."""

    def next_arm(self) -> int:
        return min(range(self.num_arms), key=lambda i: (self._n[i], i))


class TopTwoEBTCI(_GLRBestArm):
    """beta-EB-TCI (empirical-best leader, transportation-cost challenger with log-count penalty).

    ``next_arm()`` -> arm to pull, ``update(arm, reward)`` with reward in [0, 1], ``should_stop()``,
    ``best_arm()``, ``counts`` (pulls per arm). See the module docstring for the rule and the threshold.
    """

    def __init__(self, num_arms: int, delta: float, beta: float = 0.5, forced_exploration: bool = False,
                 *, tracking: bool = True, seed: int | None = None):
        super().__init__(num_arms, delta)
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in (0, 1) (got {beta})")
        self.beta = float(beta)
        self.forced_exploration = bool(forced_exploration)
        self.tracking = bool(tracking)
        self.rng = np.random.default_rng(seed)
        self.leader_times = [0] * self.num_arms  # L_{t,i}: rounds where i was the leader
        self.leader_pulls = [0] * self.num_arms  # N^i_{t,i}: pulls of i decided as leader
        self._pending_leader: int | None = None

    def challenger(self, leader: int) -> int:
        best, arg = math.inf, -1
        for j in range(self.num_arms):
            if j != leader:
                v = self._w(leader, j) + math.log(max(self._n[j], 1))
                if v < best:
                    best, arg = v, j
        return arg

    def next_arm(self) -> int:
        self._pending_leader = None
        if 0 in self._n:
            return self._n.index(0)
        if self.forced_exploration:
            low = min(range(self.num_arms), key=lambda i: (self._n[i], i))
            if self._n[low] < math.sqrt((self.t + 1) / self.num_arms):
                return low
        b = self.best_arm()
        self.leader_times[b] += 1
        if self.tracking:  # Jourdan et al.'s per-leader tracking of the fraction beta
            pull_leader = self.leader_pulls[b] <= self.beta * self.leader_times[b]
        else:
            pull_leader = self.rng.random() < self.beta
        if pull_leader:
            self._pending_leader = b
            return b
        return self.challenger(b)

    def update(self, arm: int, reward: float) -> None:
        if self._pending_leader is not None and arm == self._pending_leader:
            self.leader_pulls[arm] += 1
        self._pending_leader = None
        super().update(arm, reward)


def identify_best(sample_fn: Callable[[int], float], num_arms: int, delta: float, max_samples: int | None = None,
                  *, beta: float = 0.5, forced_exploration: bool = False, allocation: str = "top-two",
                  seed: int | None = None) -> tuple[int, int]:
    """Sample ``sample_fn(arm)`` (a reward in [0, 1]) adaptively until the GLR test is sure at level delta.

    Returns ``(best arm, total samples)``. ``allocation``: "top-two" (beta-EB-TCI) or "uniform" (the
    baseline with the same stopping rule). With ``max_samples`` the run ends there at the latest and
    returns the empirical best arm (then without the delta guarantee).
    """
    if allocation in ("top-two", "top_two", "toptwo"):
        algo: _GLRBestArm = TopTwoEBTCI(num_arms, delta, beta=beta, forced_exploration=forced_exploration,
                                        seed=seed)
    elif allocation == "uniform":
        algo = UniformAllocation(num_arms, delta)
    else:
        raise ValueError(f"allocation must be 'top-two' or 'uniform' (got {allocation!r})")
    while not algo.should_stop():
        if max_samples is not None and algo.t >= max_samples:
            break
        arm = algo.next_arm()
        algo.update(arm, sample_fn(arm))
    return algo.best_arm(), int(algo.t)


# ---------------------------------------------------------------------------------------------
# Noisy 1-D convex minimizer localization
# ---------------------------------------------------------------------------------------------
def _radius(n: int, scale: float, delta_p: float) -> float:
    """Anytime sub-Gaussian confidence radius of a mean of n samples (union over n via delta_p / (n (n + 1)))."""
    return scale * math.sqrt(2.0 * math.log(n * (n + 1) / delta_p) / n)


def localize_minimizer(f: Callable[[float], float], lo: float, hi: float, eps: float, delta: float,
                       max_evals: int | None = None, *, sigma: float = 1.0) -> tuple[float, int]:
    """A point within ``eps`` of the minimizer of a convex ``f`` on ``[lo, hi]``, with probability >= 1 - delta.

    ``f(x)`` returns a noisy value whose noise is sub-Gaussian with scale ``sigma``. Returns
    ``(x, evals)``. With ``max_evals`` the search ends there at the latest (returning the middle of the
    interval still in play, without the guarantee). Algorithm: module docstring.
    """
    if not hi > lo:
        raise ValueError(f"need lo < hi (got {lo}, {hi})")
    if eps <= 0 or not 0 < delta < 1 or sigma <= 0:
        raise ValueError("need eps > 0, 0 < delta < 1, sigma > 0")
    a, b = float(lo), float(hi)
    # rounds: quarter cuts while the interval is longer than 8 eps / 3, then one last cut down to 2 eps
    rounds = max(1, math.ceil(math.log(max((b - a) / (2 * eps), 1.0)) / math.log(4 / 3)) + 1)
    delta_p = delta / (3 * rounds)  # three pairwise comparisons per round
    evals = 0
    target = 2 * eps * (1 - 1e-6)  # a hair under 2 eps, so the midpoint is within eps despite rounding
    while b - a > target:
        length = b - a
        s = min(0.25 * length, length - 2 * eps * (1 - 1e-3))  # the last cut: just under 2 eps remains
        xs = (a + s, a + 0.5 * length, b - s)
        sums = [0.0, 0.0, 0.0]
        n = 0
        cut_left = cut_right = False
        while not (cut_left or cut_right):
            if max_evals is not None and evals + 3 > max_evals:
                return 0.5 * (a + b), evals
            for i, x in enumerate(xs):
                sums[i] += float(f(x))
            evals += 3
            n += 1
            # the three points are sampled in lockstep: a difference of two means is sub-Gaussian with
            # scale sigma * sqrt(2), so one radius serves the three pairwise comparisons
            r = _radius(n, sigma * math.sqrt(2.0), delta_p)
            fl, fc, fr = sums[0] / n, sums[1] / n, sums[2] / n
            cut_left = fl - fc > r or fl - fr > r    # the minimizer is right of x_l
            cut_right = fr - fc > r or fr - fl > r   # the minimizer is left of x_r
        a, b = (xs[0] if cut_left else a), (xs[2] if cut_right else b)
    return 0.5 * (a + b), evals


__all__ = ["C_G", "TopTwoEBTCI", "UniformAllocation", "characteristic_time", "identify_best", "kl_bernoulli",
           "localize_minimizer", "transportation_cost"]
