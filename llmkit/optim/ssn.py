"""Semismooth Newton (SSN) with lazy generalized-Hessian updates.

Paper: "semismooth Newton ... lazy Hessian updates" (NeurIPS 2026): a second-order
method for problems whose gradient is only semismooth (Lipschitz, piecewise smooth: squared hinge, ReLU-type
penalties, |w|^3 terms, Lipschitz-constrained layers) that has global rates and asymptotic superlinear
convergence, while evaluating a (generalized) Hessian only every k iterations and reusing the stale one
in between.

Algorithm (one ``step``; x = all parameters flattened, g = grad f(x)):

    every ``hessian_every`` steps:  H <- an element of the generalized Hessian at x (the oracle, or autograd:
                                    the derivative of the gradient autograd computes is an element of
                                    Clarke's generalized Jacobian for the piecewise-smooth functions above);
                                    eigendecompose H = Q diag(lam) Q^T once (the lazy, expensive part)
    lambda = reg * sqrt(||g||) + damping                       (gradient regularization)
    d = -Q diag(1 / (max(lam, 0) + lambda)) Q^T g              (cheap with the stored factorization)
    globalization: Armijo backtracking from t = lr: f(x + t d) <= f(x) + c1 t g^T d, halving t; if d is not
                   a descent direction, d = -g. (A step whose change of f is below f's rounding error is
                   accepted: near the solution the Armijo test is beyond floating-point resolution.)

The gradient regularization lambda ~ sqrt(||g||) (as in regularized Newton methods) gives the global
behaviour and vanishes at the solution, so close to it the step is the Newton step with the (stale)
generalized Hessian: superlinear convergence once the Hessian is refreshed near the solution, at
1/k of the Hessian cost. Deviations: the paper's exact regularization constants and infinite-dimensional
setting are not reproduced; the Armijo line search is our documented globalization; dense d x d Hessians
limit this to small and medium problems (the toy settings, small heads or Lipschitz-constrained layers).

``step(closure)``: the closure returns the loss with its graph (it must NOT call backward).
``hessian_fn(x) -> [d, d]`` (optional) is the generalized-Hessian oracle on the flat parameter vector.
``hessian_evals`` counts oracle calls.
"""

from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

__all__ = ["SemismoothNewton"]


class SemismoothNewton(Optimizer):
    def __init__(self, params, lr: float = 1.0, hessian_every: int = 1, hessian_fn=None, reg: float = 1.0,
                 damping: float = 1e-10, line_search: bool = True, c1: float = 1e-4, backtrack: float = 0.5,
                 max_backtracks: int = 40):
        if hessian_every < 1:
            raise ValueError(f"hessian_every must be >= 1, got {hessian_every}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if reg < 0 or damping < 0:
            raise ValueError("reg and damping must be >= 0")
        super().__init__(params, {"lr": lr})
        if len(self.param_groups) != 1:
            raise ValueError("SemismoothNewton works on one parameter group")
        self.hessian_every = hessian_every
        self.hessian_fn = hessian_fn
        self.reg, self.damping = reg, damping
        self.line_search, self.c1, self.backtrack, self.max_backtracks = line_search, c1, backtrack, max_backtracks
        self.hessian_evals = 0
        self.iterations = 0
        self._eig: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_grad_norm: float | None = None

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _set(self, flat: torch.Tensor) -> None:
        i = 0
        for p in self._params:
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p).to(p.dtype))
            i += n

    def _hessian(self, closure, x: torch.Tensor) -> torch.Tensor:
        self.hessian_evals += 1
        if self.hessian_fn is not None:
            h = torch.as_tensor(self.hessian_fn(x.clone()), dtype=x.dtype)
            return 0.5 * (h + h.T)
        with torch.enable_grad():
            loss = closure()
            grads = torch.autograd.grad(loss, self._params, create_graph=True)
            g = torch.cat([gr.reshape(-1) for gr in grads])
            rows = []
            for i in range(g.numel()):
                r = torch.autograd.grad(g[i], self._params, retain_graph=True, allow_unused=True)
                rows.append(torch.cat([(ri if ri is not None else torch.zeros_like(p)).reshape(-1)
                                       for ri, p in zip(r, self._params)]))
        h = torch.stack(rows).to(x.dtype)
        return 0.5 * (h + h.T)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None:
            raise ValueError("SemismoothNewton.step needs a closure that returns the loss (without backward)")
        x = self._flat()
        with torch.enable_grad():
            loss = closure()
            grads = torch.autograd.grad(loss, self._params, allow_unused=True)
        g = torch.cat([(gr if gr is not None else torch.zeros_like(p)).reshape(-1)
                       for gr, p in zip(grads, self._params)]).to(x.dtype)
        f0 = float(loss.detach())
        gnorm = float(g.norm())
        self.last_grad_norm = gnorm
        if self._eig is None or self.iterations % self.hessian_every == 0:
            lam, q = torch.linalg.eigh(self._hessian(closure, x))
            self._eig = (lam, q)
        lam, q = self._eig
        shift = self.reg * math.sqrt(gnorm) + self.damping
        d = -(q @ ((q.T @ g) / (lam.clamp_min(0) + shift)))
        slope = float(g @ d)
        if not slope < 0:
            d, slope = -g, -gnorm ** 2
        t = self.param_groups[0]["lr"]
        if self.line_search:
            for _ in range(self.max_backtracks):
                self._set(x + t * d)
                with torch.enable_grad():
                    f = float(closure().detach())
                # the second test accepts steps whose decrease is below the loss's rounding error (at the
                # solution the Armijo test cannot be checked in floating point)
                if f <= f0 + self.c1 * t * slope or f - f0 <= 1e-14 * max(1.0, abs(f0)):
                    break
                t *= self.backtrack
            else:
                self._set(x)  # no acceptable step: stay (the next Hessian refresh may help)
        else:
            self._set(x + t * d)
        self.iterations += 1
        return loss
