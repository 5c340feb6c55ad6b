"""Matrix completion through nullspace perturbation: a matrix-sensing surrogate solved by alternating least squares.

Paper: "injecting epsilon-level perturbations into the nullspace of the observation mask" (NeurIPS
2026). The mask operator ``P_Omega`` (keep the observed entries) has a huge nullspace
(every unobserved entry), which is what makes matrix completion hard: it has no restricted isometry. Adding
an epsilon-level perturbation on that nullspace gives the sensing operator

    A(X) = (P_Omega(X), eps * Q(P_Omega^perp(X)))          with measurements  b = (P_Omega(M), 0)

a *noisy* matrix-sensing problem: the unknown ``eps * Q(P_Omega^perp(M))`` is noise of size O(eps), A is
injective, and the surrogate's low-rank solution is O(eps)-close to the truth (on tangent directions the
observed part dominates, so in practice the error is closer to O(eps^2)).

Algorithm here: minimise ``||A(U V^T) - b||^2`` over the factors by alternating least squares. With Q
orthogonal (norm-preserving) the objective is ``sum_Omega (X_ij - M_ij)^2 + eps^2 sum_{not Omega} X_ij^2``, so
each row of U (then of V) solves its own r x r system ``(V_Oi^T V_Oi + eps^2 V^T V) u_i = V_Oi^T m_Oi``. The
perturbation is what makes every such system well posed: without it a row with fewer than r observed
entries has a singular system. Start: the spectral estimate (top-r SVD of the zero-filled observations
divided by the sampling rate), or random factors.

Continuation (``anneal_from``, default 1): ALS starts with a large perturbation and divides it by 10 per
stage down to ``eps``. In the tests' setting ALS run at eps = 1e-3 directly fails from random factors (and
from the spectral start on some masks), while the same sweeps through the eps ladder recover the matrix:
the larger perturbation is the better-curved landscape the paper describes.

Deviation: the paper's perturbation is a general epsilon-level (e.g. Gaussian) map on the nullspace; we take
an orthogonal one, which makes ALS closed-form and memory-light (a Gaussian Q would need a dense
(#sensing x #unobserved) matrix). The paper pairs the perturbation with over-parameterised models; we fit
at the target rank (an over-parameterised ALS fit, truncated afterwards, was worse in our trials). At the
final stage eps costs an O(eps^2) bias; eps=0 there (after the ladder) is plain ALS and exact where every row
and column has enough observations. Stopping: ``iters`` sweeps or a relative change below ``tol``.
"""

from __future__ import annotations

import torch

__all__ = ["complete", "low_rank_problem", "relative_error"]


def _solve_rows(Y: torch.Tensor, W: torch.Tensor, obs: torch.Tensor, eps2: float, ridge: float) -> torch.Tensor:
    """Rows u_i = argmin sum_j W_ij (u_i . y_j - obs_ij)^2 with W_ij = 1 (observed) or eps^2 (not)."""
    r = Y.shape[1]
    base = eps2 * (Y.T @ Y)                                           # r x r
    Wo = W.to(Y.dtype)                                                # [n, m] 0/1 observed
    outer = (Y[:, :, None] * Y[:, None, :]).reshape(Y.shape[0], r * r)
    G = base[None] + (1.0 - eps2) * (Wo @ outer).reshape(-1, r, r)
    G = G + ridge * torch.eye(r, dtype=Y.dtype)[None]
    rhs = (Wo * obs) @ Y                                              # unobserved targets are 0
    return torch.linalg.solve(G, rhs[..., None])[..., 0]


def complete(observed: torch.Tensor, mask: torch.Tensor, rank: int, eps: float = 1e-3, *,
             iters: int = 200, tol: float = 1e-10, init: str = "spectral", anneal_from: float | None = 1.0,
             seed: int = 0, return_info: bool = False):
    """Complete ``observed`` ([n1, n2]; values where ``mask`` is False are ignored) to a rank-``rank`` matrix.

    ``eps``: size of the nullspace perturbation (>= 0; 0 is plain ALS, whose row systems can be singular).
    ``anneal_from``: start the ALS at this perturbation size and divide it by 10 per stage down to ``eps``
    (None: start at ``eps``); ``iters`` sweeps at most per stage. Returns the completed [n1, n2] matrix
    (dtype of ``observed``), and with ``return_info`` a dict with the sweeps run and the surrogate loss."""
    M = torch.as_tensor(observed)
    dtype = M.dtype if M.is_floating_point() else torch.float64
    M64 = M.to(torch.float64)
    Om = torch.as_tensor(mask).to(torch.bool)
    if M.ndim != 2 or Om.shape != M.shape:
        raise ValueError(f"observed and mask must be [n1, n2] of one shape, got {tuple(M.shape)} and {tuple(Om.shape)}")
    if rank < 1 or rank > min(M.shape):
        raise ValueError(f"rank must be in 1..{min(M.shape)}, got {rank}")
    if eps < 0:
        raise ValueError("eps must be >= 0")
    k = rank
    obs = torch.where(Om, M64, torch.zeros((), dtype=torch.float64))
    if not torch.isfinite(obs).all():
        raise ValueError("observed entries must be finite")
    p = max(float(Om.float().mean()), 1e-12)
    if init == "spectral":
        Uo, S, Vh = torch.linalg.svd(obs / p, full_matrices=False)
        U = Uo[:, :k] * S[:k].sqrt()
        V = Vh[:k].T * S[:k].sqrt()
    elif init == "random":
        g = torch.Generator().manual_seed(seed)
        scale = (obs.norm() / (p * (M.shape[0] * M.shape[1]) ** 0.5 + 1e-300)).sqrt()
        U = torch.randn(M.shape[0], k, generator=g, dtype=torch.float64) * scale
        V = torch.randn(M.shape[1], k, generator=g, dtype=torch.float64) * scale
    else:
        raise ValueError(f"init must be 'spectral' or 'random', got {init!r}")
    ridge = 1e-12 * float(obs.abs().max() ** 2 + 1)
    # continuation in eps: a large perturbation first (a better-curved landscape), then down to eps
    levels = [float(eps)]
    if anneal_from is not None:
        while levels[0] * 10 <= anneal_from:
            levels.insert(0, levels[0] * 10)
        if eps == 0:
            levels = [anneal_from / 10 ** i for i in range(4)] + [0.0]
    X = U @ V.T
    sweeps = 0
    for level in levels:
        eps2 = level ** 2
        for _ in range(iters):
            sweeps += 1
            U = _solve_rows(V, Om, obs, eps2, ridge)
            V = _solve_rows(U, Om.T, obs.T, eps2, ridge)
            new = U @ V.T
            change = float((new - X).norm() / max(float(new.norm()), 1e-300))
            X = new
            if change <= tol:
                break
    eps2 = float(eps) ** 2
    loss = float(((X - obs)[Om] ** 2).sum() + eps2 * (X[~Om] ** 2).sum())
    out = X.to(dtype)
    return (out, {"sweeps": sweeps, "surrogate_loss": loss}) if return_info else out


def relative_error(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    """||estimate - truth||_F / ||truth||_F."""
    return float((estimate.to(torch.float64) - truth.to(torch.float64)).norm() / truth.to(torch.float64).norm())


def low_rank_problem(n1: int, n2: int, rank: int, fraction: float, seed: int = 0):
    """A random rank-``rank`` matrix (Gaussian factors) and a Bernoulli(``fraction``) observation mask."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(n1, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, n2, generator=g,
                                                                                     dtype=torch.float64)
    mask = torch.rand(n1, n2, generator=g) < fraction
    return truth, mask
