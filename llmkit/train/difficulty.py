"""A GSM8K difficulty regressor: predicts how many solution steps a problem needs from its question text.

Used to order or filter training problems by expected length of reasoning (a curriculum, or picking problems
that fit a generation budget) without running a model. The target is imbalanced: in GSM8K train most
reference solutions take 2-4 steps and few take 7-9, so plain least squares fits the bulk and under-predicts
the long problems. ``weighting="tc_dro"`` trains with target-conditional DRO example weights
(``llmkit.optim.dro.tc_dro_weights``: one region per step count, larger radii where counts are scarce);
``chi2`` (global chi-square DRO) and ``erm`` (the default) are the baselines. Which one helps is an empirical
question: ``bench/optim_structured.py`` measures all three on GSM8K test (bench/results/optim_structured.md);
the default stays ``erm``.

Features: hashed word unigrams and bigrams of the question (``sklearn``'s ``HashingVectorizer``) plus the
log counts of numbers and words. Model: ridge-regularised weighted least squares.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from llmkit.optim import dro

__all__ = ["WEIGHTINGS", "DifficultyRegressor", "question_features", "solution_steps"]

WEIGHTINGS = ("erm", "chi2", "tc_dro")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")


def solution_steps(answer: str) -> int:
    """Number of non-empty reasoning lines before ``####`` in a GSM8K reference answer."""
    return sum(1 for line in answer.split("####")[0].splitlines() if line.strip())


def question_features(questions: list[str], n_features: int = 512) -> np.ndarray:
    from sklearn.feature_extraction.text import HashingVectorizer

    hv = HashingVectorizer(n_features=n_features, alternate_sign=False, norm="l2", ngram_range=(1, 2))
    H = hv.transform(questions).toarray()
    extra = np.array([[np.log1p(len(_NUMBER.findall(q))), np.log1p(len(q.split()))] for q in questions])
    return np.hstack([H, extra])


@dataclass
class DifficultyRegressor:
    """``fit(questions, steps)`` then ``predict(questions)``."""

    weighting: str = "erm"
    radius: float = 0.1
    num_regions: int = 8
    ridge: float = 1e-3
    rounds: int = 10
    n_features: int = 512

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")

    def _weight_fn(self):
        if self.weighting == "erm":
            return None
        if self.weighting == "chi2":
            return lambda t, loss: dro.chi2_dro_weights(loss, self.radius)
        return lambda t, loss: dro.tc_dro_weights(t, loss, self.num_regions, self.radius)

    def fit(self, questions: list[str], steps) -> DifficultyRegressor:
        X = question_features(questions, self.n_features)
        self.coef_ = dro.fit_weighted_linear(X, np.asarray(steps, dtype=np.float64), self._weight_fn(),
                                             rounds=self.rounds, ridge=self.ridge)
        return self

    def predict(self, questions: list[str]) -> np.ndarray:
        X = question_features(questions, self.n_features)
        return self.coef_[0] + X @ self.coef_[1:]
