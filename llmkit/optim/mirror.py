"""Stochastic mirror descent (SMD), unmodified, for heavy-tailed gradient noise.

Paper: "Stochastic Mirror Descent / SGD under heavy-tailed noise without modification",
NeurIPS 2026. The paper proves in-expectation convergence of plain SMD for convex
problems (and SGD for nonconvex ones) when the gradient noise has only a finite p-th moment, p in (1, 2]
(infinite variance), with no clipping or normalization and without a bounded domain. So the update rule
below is the textbook one; what matters is the step size (decreasing, as the theory prescribes: pass a
scheduler) and the averaged iterate, which ``averaged()`` returns.

Algorithm, with a mirror map psi (strictly convex), per parameter tensor x and gradient g:

    grad psi(x_{t+1}) = grad psi(x_t) - lr_t * g_t     (then map back with grad psi*)

  * ``euclidean``: psi = ||x||^2 / 2, i.e. SGD.
  * ``entropy``: psi = sum x log x on the probability simplex: x <- x * exp(-lr g) / sum(...) (exponentiated
    gradient). Each parameter tensor, flattened, must be a probability vector (non-negative, summing to 1) and
    stays one after every step (mixture weights). The update runs in log space (log-sum-exp), so a huge
    noisy gradient cannot overflow, and the log-weights are kept in the optimizer state so a weight that
    underflows to 0 can still recover.
  * ``p_norm``: psi = ||x||_p^2 / 2, 1 < p <= 2 (default p = 1 + 1 / ln(d), the classic choice that makes
    SMD behave like l1 geometry in high dimension); grad psi(x) = sign(x)|x|^{p-1} ||x||_p^{2-p} and its
    inverse is the same map with the conjugate exponent q = p / (p - 1).

``averaged()`` gives the lr-weighted average of the iterates (sum lr_t x_t / sum lr_t), the point the
convex theory bounds. Deviations: none in the update; the paper's step-size constants are left to the caller.
"""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from ._closure import evaluate_closure

__all__ = ["MIRRORS", "MirrorDescent"]

MIRRORS = ("euclidean", "entropy", "p_norm")


def _grad_psi(x: torch.Tensor, p: float) -> torch.Tensor:
    n = x.norm(p=p)
    if n == 0:
        return torch.zeros_like(x)
    return torch.sign(x) * x.abs().pow(p - 1) * n.pow(2 - p)


class MirrorDescent(Optimizer):
    """Stochastic mirror descent: ``mirror`` = euclidean | entropy | p_norm (with ``p``)."""

    def __init__(self, params, lr: float, mirror: str = "euclidean", p: float | None = None,
                 simplex_tol: float = 1e-4):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if mirror not in MIRRORS:
            raise ValueError(f"mirror must be one of {', '.join(MIRRORS)}, got {mirror!r}")
        if p is not None and not p > 1.0:
            raise ValueError(f"p must be > 1 for the p_norm mirror map, got {p}")
        super().__init__(params, {"lr": lr, "mirror": mirror, "p": p})
        for group in self.param_groups:
            if group["mirror"] == "entropy":
                for x in group["params"]:
                    v = x.detach()
                    if (v < 0).any() or abs(float(v.sum()) - 1.0) > simplex_tol:
                        raise ValueError("mirror='entropy' needs every parameter to be a probability vector "
                                         f"(non-negative entries summing to 1); got one of shape {tuple(v.shape)} "
                                         f"summing to {float(v.sum()):.6g} with min {float(v.min()):.3g}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, mirror = group["lr"], group["mirror"]
            for x in group["params"]:
                if x.grad is None:
                    continue
                g = x.grad
                st = self.state[x]
                if mirror == "euclidean":
                    x.add_(g, alpha=-lr)
                elif mirror == "entropy":
                    if "log_weights" not in st:
                        st["log_weights"] = x.detach().double().clamp_min(0).log()
                    logw = st["log_weights"]
                    logw.add_(g.double(), alpha=-lr)
                    finite = torch.isfinite(logw)
                    logw.sub_(torch.logsumexp(logw[finite], dim=0)) if finite.any() else None
                    x.copy_(torch.softmax(logw.flatten(), dim=0).view_as(x).to(x.dtype))
                else:
                    pp = group["p"] or (1.0 + 1.0 / math.log(max(x.numel(), 3)))
                    q = pp / (pp - 1.0)
                    theta = _grad_psi(x.detach().double(), pp) - lr * g.double()
                    x.copy_(_grad_psi(theta, q).to(x.dtype))
                if lr > 0:
                    if "avg" not in st:
                        st["avg"] = x.detach().clone().double()
                        st["avg_weight"] = lr
                    else:
                        st["avg_weight"] += lr
                        st["avg"].add_(x.detach().double() - st["avg"], alpha=lr / st["avg_weight"])
        return loss

    def averaged(self) -> list[torch.Tensor]:
        """The lr-weighted average iterate of every parameter (the current value where no step was taken)."""
        out = []
        for group in self.param_groups:
            for x in group["params"]:
                st = self.state.get(x, {})
                out.append(st["avg"].to(x.dtype) if "avg" in st else x.detach().clone())
        return out
