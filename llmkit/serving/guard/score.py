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

That is the ``"energy"`` score (a Mahalanobis energy). The ``"entropic"`` score
(:func:`entropic_layer_score`) also counts the trajectory's own entropy, so it is a
divergence. Per layer: whiten the token states against the compliant manifold
(``Manifold.whiten``: ``z_t`` in the k principal directions over their standard deviations,
``r_t`` the off-subspace residual over ``sqrt(noise)``), so that ``q`` is ``N(0, I)``; model the
trajectory as a Gaussian ``p`` with mean ``m`` and Ledoit-Wolf shrunk covariance (eigenvalues
``s_i``) of the ``z_t``, and off the subspace mean ``m_r`` and one isotropic variance ``v``. Then

    KL(p || q) = 1/2 [ |m|^2 + sum_i f(s_i) + |m_r|^2 + (d - k) f(v) ],   f(s) = s - 1 - log s

and the layer score is ``KL / d``. The *asymmetric* form (the default, ``asymmetric=True``)
uses ``f_+(s) = f(s)`` for ``s > 1`` and ``0`` otherwise: only scatter beyond the compliant
spread and drift count, and a trajectory tighter than the manifold (a short or repetitive
answer) is not chaos. That is AEO's asymmetry written into the score. Layer scores are
calibrated and combined exactly as for the energy score.

Windows. A long response is scored window by window (:func:`windows`: ``size`` tokens,
half-overlapping, the last one ending at the response's end) and its score is the
maximum over windows, so a violation that starts late is not averaged away by a long
compliant beginning. A response no longer than one window is scored whole, as before.
The supervised ``"probe"`` and ``"combined"`` scores (:mod:`probe`) use the same windows.
"""

from __future__ import annotations

import torch

from llmkit.serving.guard.capture import Capture
from llmkit.serving.guard.manifold import Manifold

CHAOS_SCORES = ("energy", "entropic")  # unsupervised: fitted on compliant responses only
SCORES = (*CHAOS_SCORES, "probe", "combined")  # probe and combined also need violations to fit


def windows(n_tokens: int, size: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` covering ``n_tokens`` rows: ``size`` long, stride ``size // 2``, the last
    one ending at ``n_tokens``; one window when ``n_tokens <= size``."""
    if size < 1:
        raise ValueError(f"window size must be at least 1 token, got {size}")
    if n_tokens <= size:
        return [(0, max(1, n_tokens))]
    stride = max(1, size // 2)
    starts = list(range(0, n_tokens - size + 1, stride))
    if starts[-1] + size < n_tokens:
        starts.append(n_tokens - size)
    return [(a, a + size) for a in starts]


def window_layer_scores(cap: Capture, manifolds: dict[int, Manifold], kind: str, size: int) -> torch.Tensor:
    """Raw per-layer scores of each window of one response: (n_windows, n_layers)."""
    if kind not in CHAOS_SCORES:
        raise ValueError(f"unknown chaos score '{kind}': choose from {', '.join(CHAOS_SCORES)}")
    first = next(iter(manifolds))
    spans = windows(cap.states[first].shape[0], size)
    cols = []
    for l, m in manifolds.items():
        x = cap.states[l]
        if kind == "energy":
            e = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.float64), m.energy(x).double()]), 0)
            cols.append(torch.tensor([float(e[b] - e[a]) / (b - a) for a, b in spans], dtype=torch.float64))
        else:
            cols.append(torch.tensor([entropic_layer_score(x[a:b], m) for a, b in spans], dtype=torch.float64))
    return torch.stack(cols, 1)


def entropic_layer_score(states: torch.Tensor, manifold: Manifold, asymmetric: bool = True) -> float:
    """``KL(p_trajectory || q_compliant) / d`` of one response's states (T x d) at one layer.

    See the module docstring for the exact definition. A one-token trajectory has no
    spread (``S = 0``, ``v = 0``): with ``asymmetric=True`` only its drift counts; the
    symmetric KL is then huge (``-log`` of a zero variance, floored at 1e-12).
    """
    from sklearn.covariance import ledoit_wolf

    z, r = manifold.whiten(states)
    t, k = z.shape
    d = manifold.dim
    m = z.mean(0)
    if t >= 2:
        cov, _ = ledoit_wolf(z.numpy())
        s = torch.linalg.eigvalsh(torch.from_numpy(cov))
    else:
        s = torch.zeros(k, dtype=torch.float64)
    mr = r.mean(0)
    v = ((r - mr) ** 2).sum(-1).mean() / max(1, d - k)

    def f(x):
        x = torch.as_tensor(x, dtype=torch.float64).clamp_min(1e-12)
        out = x - 1 - torch.log(x)
        return torch.where(x > 1, out, torch.zeros_like(out)) if asymmetric else out

    kl = 0.5 * (float(m @ m) + float(f(s).sum()) + float(mr @ mr) + (d - k) * float(f(v)))
    return kl / d


def layer_scores(caps: list[Capture], manifolds: dict[int, Manifold], kind: str = "energy") -> torch.Tensor:
    """Raw per-layer scores: (n_responses, n_layers), layers in ``manifolds`` order.

    ``kind="energy"``: ``c_l`` (mean Mahalanobis energy); ``kind="entropic"``: the asymmetric
    entropic divergence of :func:`entropic_layer_score`.
    """
    if kind not in CHAOS_SCORES:
        raise ValueError(f"unknown chaos score '{kind}': choose from {', '.join(CHAOS_SCORES)}")
    rows = []
    for cap in caps:
        if kind == "energy":
            rows.append([float(m.energy(cap.states[l]).mean()) for l, m in manifolds.items()])
        else:
            rows.append([entropic_layer_score(cap.states[l], m) for l, m in manifolds.items()])
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
