"""Supervised guard scores: a linear probe on the guard layers' pooled states, and its combination
with the chaos score.

The probe follows TaskTracker ("Get my drift? Catching LLM Task Drift with Activation Deltas",
Abdelnabi et al.): a linear classifier on a model's activations, trained on labelled examples of
instructions followed and instructions hijacked, that detects when an input made the model
drift from its task. Here the activations are the AEO guard's own: the mean of a response
window's states at each guard layer, concatenated (:func:`pooled_windows`).

Algorithm
---------
- ``"probe"``: standardise the pooled features, fit an L2-regularised logistic regression
  (scikit-learn, balanced class weights) on the fitting part's compliant and violating
  responses; the score is its decision value (the log-odds of a violation).
- ``"combined"``: a second logistic regression, fitted on the *held-out* part (responses the
  manifold and the probe never saw), over two features: the energy chaos score and the
  probe's decision value. Its decision value is the score. Calibrating the combination on
  held-out rows keeps the probe's fit to its own training rows from dominating.

Both are scored per window and maximised over a response's windows like the chaos scores
(:func:`llmkit.serving.guard.score.windows`), and the threshold is set on held-out compliant
responses at the target false-positive rate.

Deviations from TaskTracker: the probe reads the response's states (the guard's trajectory),
not the difference between activations before and after a block of retrieved text, because
a serving guard sees a finished answer; a response longer than one window contributes each
of its windows with weight ``1 / n_windows`` and the response's label, so a long answer
counts once. The weights are stored as plain tensors (no pickled scikit-learn object), so a
saved guard loads without scikit-learn and scores with torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmkit.serving.guard.capture import Capture
from llmkit.serving.guard.score import windows


@dataclass
class LinearProbe:
    """``decision(x) = ((x - mean) / scale) @ coef + intercept``: a standardised logistic regression."""

    mean: torch.Tensor  # (F,)
    scale: torch.Tensor  # (F,)
    coef: torch.Tensor  # (F,)
    intercept: torch.Tensor  # ()

    @classmethod
    def fit(cls, x, labels, *, C: float = 0.1, sample_weight=None, seed: int = 0) -> LinearProbe:
        """scikit-learn's ``StandardScaler`` + ``LogisticRegression(C, class_weight="balanced")`` on rows ``x``."""
        import numpy as np
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler

        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(labels, dtype=int)
        if x.ndim != 2 or x.shape[0] != y.shape[0]:
            raise ValueError(f"probe features {x.shape} and labels {y.shape} do not match")
        if len(set(y.tolist())) < 2:
            raise ValueError("the probe needs both compliant and violating training examples")
        scaler = StandardScaler().fit(x, sample_weight=sample_weight)
        lr = LogisticRegression(C=C, max_iter=5000, class_weight="balanced", random_state=seed)
        lr.fit(scaler.transform(x), y, sample_weight=sample_weight)
        scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
        return cls(mean=torch.from_numpy(scaler.mean_.copy()), scale=torch.from_numpy(scale.copy()),
                   coef=torch.from_numpy(lr.coef_[0].copy()), intercept=torch.tensor(float(lr.intercept_[0])))

    def decision(self, x) -> torch.Tensor:
        x = torch.as_tensor(x).double()
        return ((x - self.mean.double()) / self.scale.double()) @ self.coef.double() + self.intercept.double()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.mean": self.mean.float(), f"{prefix}.scale": self.scale.float(),
                f"{prefix}.coef": self.coef.float(), f"{prefix}.intercept": self.intercept.reshape(1).float()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> LinearProbe:
        missing = [k for k in ("mean", "scale", "coef", "intercept") if f"{prefix}.{k}" not in t]
        if missing:
            raise ValueError(f"the guard's tensors lack {', '.join(f'{prefix}.{k}' for k in missing)}")
        return cls(mean=t[f"{prefix}.mean"], scale=t[f"{prefix}.scale"], coef=t[f"{prefix}.coef"],
                   intercept=t[f"{prefix}.intercept"].reshape(()))


def pooled_windows(cap: Capture, layers: list[int], size: int) -> torch.Tensor:
    """(n_windows, L*d): each window's mean state per layer, concatenated (windows of :func:`windows`)."""
    spans = windows(cap.states[layers[0]].shape[0], size)
    cols = []
    for l in layers:
        x = cap.states[l].double()
        c = torch.cumsum(torch.cat([torch.zeros(1, x.shape[1], dtype=torch.float64), x]), 0)
        cols.append(torch.stack([(c[b] - c[a]) / (b - a) for a, b in spans]))
    return torch.cat(cols, 1)


def window_rows(caps: list[Capture], labels: list[int], features) -> tuple[torch.Tensor, list[int], list[float]]:
    """Training rows from every window of every response: ``(x, y, weights)``, each response weighing 1 in all.

    ``features(cap)`` gives a capture's (n_windows, F) rows.
    """
    xs, ys, ws = [], [], []
    for cap, y in zip(caps, labels):
        f = features(cap)
        xs.append(f)
        ys += [int(y)] * f.shape[0]
        ws += [1.0 / f.shape[0]] * f.shape[0]
    return torch.cat(xs), ys, ws
