"""The chaos score: how far a response's latent trajectory strays from the compliant manifold.

For a response with token states ``h_1..h_T`` at layer ``l`` and that layer's
compliant Gaussian ``q_l`` (see :mod:`manifold`), the raw layer score is the
cross-entropy of the trajectory's empirical distribution against ``q_l``, per
dimension and up to constants:

    c_l = (1/T) sum_t E_l(h_t),   E_l(h) = (h - mu)^T Sigma_l^{-1} (h - mu) / d

Writing ``m`` and ``S`` for the trajectory's mean and (biased) covariance,
``c_l = [(m - mu)^T Sigma^{-1} (m - mu) + tr(Sigma^{-1} S)] / d``: a drift term
(the trajectory sits elsewhere) plus a scatter term (it spreads in directions
the compliant responses do not use). Each layer score is standardised with
the median and MAD of held-out compliant responses, and the chaos score is the
mean over layers: ``chaos = mean_l (c_l - med_l) / (1.4826 MAD_l)``. The guard
flags a response when ``chaos > threshold``, the ``1 - target_fpr`` quantile of
the held-out compliant chaos scores.
"""

from __future__ import annotations

import torch

from llmkit.serving.guard.capture import Capture
from llmkit.serving.guard.manifold import Manifold


def layer_scores(caps: list[Capture], manifolds: dict[int, Manifold]) -> torch.Tensor:
    """Raw per-layer scores ``c_l``: (n_responses, n_layers), layers in ``manifolds`` order."""
    rows = []
    for cap in caps:
        rows.append([float(m.energy(cap.states[l]).mean()) for l, m in manifolds.items()])
    return torch.tensor(rows, dtype=torch.float64).reshape(len(caps), len(manifolds))


def robust_scale(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column median and MAD-based scale of compliant scores (the calibration)."""
    med = raw.median(0).values
    mad = (raw - med).abs().median(0).values * 1.4826
    # a layer whose compliant scores barely vary must not dominate through a tiny denominator
    scale = torch.maximum(mad, 1e-6 * med.abs().clamp_min(1e-12))
    return med, scale


def chaos(raw: torch.Tensor, center: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Combine raw layer scores (n, L) into one chaos score per response (n,)."""
    return ((raw - center) / scale).mean(1)


def threshold_at_fpr(compliant_scores: torch.Tensor, target_fpr: float) -> float:
    """The score above which at most ``target_fpr`` of the compliant scores lie."""
    s = compliant_scores.double().sort().values
    n = s.numel()
    if n == 0:
        raise ValueError("no held-out compliant scores to set a threshold from")
    # the smallest order statistic with at most floor(target_fpr * n) scores strictly above it
    k = min(n - 1, max(0, n - 1 - int(target_fpr * n)))
    return float(s[k])
