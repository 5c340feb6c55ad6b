"""Infer the ``reward_weights`` of a multi-reward recipe from pairwise preferences (inverse optimization).

A GRPO recipe with several reward functions combines them as ``sum_k w_k r_k`` (TRL's ``reward_weights``).
Given pairs of completions where a person preferred one, each completion's reward vector is the feature
vector of an action and the preferred one is the chosen action of a two-candidate demonstration; noiseless
inverse optimization (``llmkit.optim.inverse.fit_objective``) returns weights under which every preferred
completion scores at least as high as the one it beat. With T consistent pairs the weights mis-rank a fresh
pair with probability O(d / T) (d = number of rewards).

The weights are returned scaled so that their absolute values average 1 (TRL's default is all ones), ready
for ``reward_weights`` in a recipe config. ``simulate_preference_pairs`` makes noiseless pairs from planted
weights (tests, benches).
"""

from __future__ import annotations

import numpy as np

from llmkit.optim.inverse import fit_objective

__all__ = ["infer_reward_weights", "pairwise_agreement", "simulate_preference_pairs"]


def infer_reward_weights(preferred_rewards, rejected_rewards, *, method: str = "perceptron") -> list[float]:
    """Weights (one per reward function) consistent with ``preferred[i] . w >= rejected[i] . w``.

    ``preferred_rewards`` and ``rejected_rewards``: [num_pairs, num_rewards] arrays of the reward functions'
    values on the preferred and the rejected completion of each pair."""
    P = np.asarray(preferred_rewards, dtype=np.float64)
    R = np.asarray(rejected_rewards, dtype=np.float64)
    if P.ndim != 2 or P.shape != R.shape:
        raise ValueError(f"preferred and rejected rewards must be [num_pairs, num_rewards] arrays of one shape, "
                         f"got {P.shape} and {R.shape}")
    feasible = [np.stack([p, r]) for p, r in zip(P, R)]
    theta = fit_objective(None, [0] * len(P), feasible, method=method)
    scale = np.abs(theta).mean()
    return (theta / scale if scale > 0 else theta).tolist()


def simulate_preference_pairs(weights, num_pairs: int, *, seed: int = 0, binary: tuple[int, ...] = ()):
    """Noiseless preference pairs under planted ``weights``: reward vectors of two completions per pair
    (uniform in [0, 1], or {0, 1} for the reward indices in ``binary``, like a correctness reward); the one
    with the higher weighted sum is preferred. Returns (preferred, rejected), each [num_pairs, num_rewards]."""
    w = np.asarray(weights, dtype=np.float64)
    rng = np.random.default_rng(seed)
    a = rng.uniform(0, 1, (num_pairs, len(w)))
    b = rng.uniform(0, 1, (num_pairs, len(w)))
    for k in binary:
        a[:, k] = rng.integers(0, 2, num_pairs)
        b[:, k] = rng.integers(0, 2, num_pairs)
    first = a @ w >= b @ w
    return np.where(first[:, None], a, b), np.where(first[:, None], b, a)


def pairwise_agreement(weights, preferred_rewards, rejected_rewards) -> float:
    """Fraction of pairs the weights rank the way the person did (ties count as disagreement)."""
    w = np.asarray(weights, dtype=np.float64)
    return float(np.mean(np.asarray(preferred_rewards) @ w > np.asarray(rejected_rewards) @ w))
