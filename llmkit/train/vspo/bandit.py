"""VSPO's bandit abstraction, simulated: iterations until the policy shows a target behaviour.

Paper: "Vector-Steered Policy Optimization" (VSPO), NeurIPS 2026: "under a bandit
abstraction, VSPO provably achieves better iteration complexity than reward-shaped GRPO when the
steering-induced distributions are sufficiently aligned with the target behavior".

Model. The policy is a softmax over K responses (arms), ``pi = softmax(theta)``. Each arm is correct or not
(task reward c); a few correct arms also show the behaviour (b). The shaped reward is ``c + b``; the target
set is the correct behaviour arms, with total initial probability ``p0``. One iteration is one GRPO step:
draw ``groups`` groups of G arms, normalise the rewards inside each group into advantages (a group with a
single reward value carries none), and ascend ``sum_i A_i grad log pi(a_i)`` (softmax: ``e_a - pi``).

- ``reward_shaping`` (GRPO): every arm is drawn from pi; while pi(target) is tiny, groups almost never
  hold a target arm and the behaviour reward gives no signal.
- ``vspo_*``: the g-th arm of a group is drawn from the steered distribution ``q_alpha ∝ pi * exp(alpha_g s)``
  with ``alpha_g`` spread evenly over [0, alpha_top]; the update still uses the unsteered ``grad log pi``
  (no importance weights), as ``VSPOTrainer`` does. ``s`` is the steering direction in logit space:
  *aligned* = the behaviour indicator b; *misaligned* = the indicator of as many arms without the
  behaviour. ``alpha_top`` either anneals linearly from ``alpha_max`` to 0 over ``anneal`` iterations
  (``schedule="linear"``, what the trainer does by default) or stays at ``alpha_max`` (``"fixed"``).

Censoring. A run that has not reached the target by ``max_iters`` is right-censored: we know only that
its hitting time exceeds the cap. ``summarize`` therefore reports the number reached and the Kaplan-Meier
median (``scipy.stats.ecdf`` on ``CensoredData``), which is ``None`` ("not reached by the cap") when fewer
than half the runs got there, instead of counting censored runs as the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

METHODS = ("reward_shaping", "vspo_aligned", "vspo_aligned_fixed", "vspo_misaligned", "vspo_misaligned_fixed")


@dataclass
class BanditConfig:
    arms: int = 50
    correct: int = 10          # arms with task reward 1
    behavior_arms: int = 3     # correct arms that also show the behaviour
    p0: float = 0.05           # initial probability of the target arms together
    target: float = 0.9        # target pi(target)
    group: int = 8             # GRPO group size G
    groups: int = 4            # groups (prompts) per iteration
    lr: float = 2.0
    alpha_max: float = 6.0
    anneal: int = 300          # iterations over which a linear schedule reaches 0
    max_iters: int = 2000

    def __post_init__(self):
        if not 0 < self.p0 < 1:
            raise ValueError(f"p0 must be in (0, 1), got {self.p0}")
        if not 0 < self.behavior_arms <= self.correct < self.arms:
            raise ValueError("need 0 < behavior_arms <= correct < arms")
        if self.group < 2 or self.groups < 1 or self.max_iters < 1 or self.anneal < 1:
            raise ValueError("need group >= 2, groups >= 1, max_iters >= 1, anneal >= 1")


def make_problem(rng: np.random.Generator, cfg: BanditConfig):
    """(theta, reward, behaviour indicator, target mask) with pi(target) = p0 at theta."""
    c = np.zeros(cfg.arms)
    b = np.zeros(cfg.arms)
    c[:cfg.correct] = 1.0
    b[cfg.correct - cfg.behavior_arms:cfg.correct] = 1.0  # behaviour arms: correct answers given the desired way
    target = (c == 1) & (b == 1)
    theta = rng.normal(0.0, 1.0, cfg.arms)
    others = np.logaddexp.reduce(theta[~target])
    theta[target] = others + math.log(cfg.p0 / (1 - cfg.p0)) - math.log(target.sum())
    return theta, c + b, b, target


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def alpha_top(method: str, it: int, cfg: BanditConfig) -> float:
    if method == "reward_shaping":
        return 0.0
    if method.endswith("_fixed"):
        return cfg.alpha_max
    return cfg.alpha_max * max(0.0, 1.0 - it / cfg.anneal)


def run(method: str, seed: int, cfg: BanditConfig) -> tuple[int | None, list[float]]:
    """(first iteration with pi(target) >= target, or None if not reached within max_iters; the pi(target) curve)."""
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}': choose from {', '.join(METHODS)}")
    rng = np.random.default_rng(seed)
    theta, reward, b, target = make_problem(np.random.default_rng(1000 + seed), cfg)
    s = None
    if method.startswith("vspo_aligned"):
        s = b.copy()
    elif method.startswith("vspo_misaligned"):
        s = np.zeros(cfg.arms)
        s[rng.choice(np.flatnonzero(b == 0), size=int(b.sum()), replace=False)] = 1.0
    curve: list[float] = []
    for it in range(cfg.max_iters):
        pi = softmax(theta)
        curve.append(float(pi[target].sum()))
        if curve[-1] >= cfg.target:
            return it, curve
        if s is None:
            draws = rng.choice(cfg.arms, size=(cfg.groups, cfg.group), p=pi)
        else:  # column g of every group comes from q_{alpha_g}
            alphas = np.linspace(0.0, alpha_top(method, it, cfg), cfg.group)
            draws = np.stack([rng.choice(cfg.arms, size=cfg.groups, p=softmax(theta + a * s)) for a in alphas], 1)
        grad = np.zeros_like(theta)
        for arms in draws:
            r = reward[arms]
            std = r.std()
            if std < 1e-8:
                continue
            adv = (r - r.mean()) / (std + 1e-4)
            grad -= pi * adv.sum()
            np.add.at(grad, arms, adv)
        theta = theta + cfg.lr * grad / (cfg.groups * cfg.group)
    return None, curve


def km_median(times: list[int | None], cap: int) -> float | None:
    """Kaplan-Meier median hitting time; ``None`` in ``times`` is a run censored at ``cap``. Returns None when the
    survival curve never falls to 0.5 (the median is not reached by the cap)."""
    from scipy.stats import CensoredData, ecdf

    done = [float(t) for t in times if t is not None]
    cens = [float(cap) for t in times if t is None]
    if not done:
        return None
    res = ecdf(CensoredData(uncensored=done, right=cens))
    sf = res.sf
    below = np.flatnonzero(sf.probabilities <= 0.5)
    return float(sf.quantiles[below[0]]) if below.size else None


def summarize(times: list[int | None], cap: int) -> dict:
    """Reached count, KM median (None = not reached by the cap) and the median over reached runs only."""
    done = [t for t in times if t is not None]
    return {"runs": len(times), "reached": len(done), "censored": len(times) - len(done),
            "km_median_iters": km_median(times, cap),
            "median_iters_reached_only": float(np.median(done)) if done else None, "cap": cap}


def speedup(shaping: dict, other: dict) -> tuple[float | None, str]:
    """Ratio of KM medians, shaping / other, and what it is: 'ratio', 'lower_bound' (shaping's median is past the
    cap, so the cap / other's median bounds the ratio from below) or 'undefined' (other's median is past the cap)."""
    a, b = shaping["km_median_iters"], other["km_median_iters"]
    if b is None:
        return None, "undefined"
    if a is None:
        return shaping["cap"] / max(b, 1.0), "lower_bound"
    return a / max(b, 1.0), "ratio"
