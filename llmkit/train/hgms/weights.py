"""Source weights on the simplex and the update rule of each weighting method (pure tensor/number code).

All rules but ODM are one step of stochastic mirror descent (exponentiated gradient) on the simplex,
``w <- normalize(w * exp(lr * score))``, followed by smoothing toward uniform, ``w <- (1 - c) w + c / K``
(keeps every source sampled and the weights away from the boundary). They differ only in the score:

* ``hgms``:   score = -hypergradient dF/dw (descent on the outer loss through the inner solution).
* ``doremi``: score = per-source excess loss max(l_k(theta) - l_k(ref), 0) (DoReMi, Xie et al. 2023).
* ``doge``:   score = <grad l_k, grad l_target> (DoGE's out-of-domain generalization estimate).
* ``uniform``: never updated.

``normalize=True`` divides the score by its largest magnitude first, so ``lr`` is the largest
log-weight change per update whatever the score's units (nats, squared gradient norms ...): the
methods are then compared at the same step size. DoReMi's original is unnormalized; set
``weights_normalize: false`` for that.

``hgms_trust`` damps HG-MS's step (its ``lr`` times a factor in [0, 1]) when the hypergradient's
assumptions visibly fail: the inner problem is not near a minimizer (gradient norm growing, negative
curvature) or the truncated Lanczos model of the Hessian does not solve its own system.

``Exp3`` is ODM (Albalak et al. 2023, "Efficient online data mixing"): EXP3 over sources with the
training loss of the examples drawn from a source as its reward, importance weighted, in an
exponential moving average; the sampling distribution mixes in ``eps_t = min(1/K, sqrt(ln K / (K t)))``
exploration. It needs no extra pass: the losses come from the training forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def project_simplex_floor(w: torch.Tensor, smoothing: float) -> torch.Tensor:
    """(1 - c) * w / sum(w) + c / K: on the simplex, every entry >= c / K."""
    w = w.double().clamp_min(0)
    w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / w.numel())
    return (1 - smoothing) * w + smoothing / w.numel()


def exponentiated_step(w: torch.Tensor, score: torch.Tensor, lr: float, smoothing: float = 0.0,
                       normalize: bool = True) -> torch.Tensor:
    """Mirror-descent step on the simplex (entropy mirror map) toward larger ``score``."""
    w = w.double()
    s = torch.as_tensor(score, dtype=torch.float64)
    s = torch.nan_to_num(s, nan=0.0, posinf=0.0, neginf=0.0)
    if normalize:
        m = s.abs().max()
        s = s / m if m > 0 else s
    logits = w.clamp_min(1e-300).log() + lr * s
    return project_simplex_floor(torch.softmax(logits, 0), smoothing)


def doremi_score(model_losses: torch.Tensor, ref_losses: torch.Tensor) -> torch.Tensor:
    """DoReMi's per-domain excess loss, clipped at zero."""
    return (torch.as_tensor(model_losses, dtype=torch.float64)
            - torch.as_tensor(ref_losses, dtype=torch.float64)).clamp_min(0)


def doge_score(source_grads: torch.Tensor, target_grad: torch.Tensor) -> torch.Tensor:
    """DoGE: alignment of each source's gradient (rows of a [K, d] matrix) with the target gradient."""
    return (source_grads.double() @ target_grad.double()).detach()


def hgms_score(hypergrad: torch.Tensor) -> torch.Tensor:
    return -torch.as_tensor(hypergrad, dtype=torch.float64)


def hgms_trust(grad_ratio: float, negative_curvature: float, solve_residual: float, *, newton_gap: float = 0.0,
               max_grad_ratio: float = 2.0, max_negative_curvature: float = 0.5, max_solve_residual: float = 1.0,
               max_newton_gap: float = 0.1) -> dict[str, float]:
    """How much to believe one hypergradient, in [0, 1] (the weight step is multiplied by it).

    The hypergradient is the derivative through the inner solution; it describes the current iterate
    only when that iterate is near a minimizer of the inner loss and the truncated Hessian model is
    good. Four readings, each 1 when that holds and 0 when it plainly does not, multiplied:

    * ``grad_ratio``: the inner gradient norm (smoothed) over its value at the first update. Training
      should shrink it; at ``max_grad_ratio`` times the start the iterate is moving away: 0.
    * ``negative_curvature``: max(0, -theta_min / theta_max) over the Ritz values. A minimizer has a
      positive semidefinite Hessian; at ``max_negative_curvature`` the point is a saddle region: 0.
    * ``solve_residual``: ||H x - P b|| / ||P b|| of the Krylov solve (minimal residual on the kept Ritz
      vectors, so in [0, 1]); at ``max_solve_residual`` (1 is no better than x = 0) the Hessian model
      explains nothing: 0.
    * ``newton_gap``: (1/2) grad g^T H^+ grad g / g, the Newton decrement's estimate of how much of the
      inner loss one Newton step would still remove (on the explored subspace): the standard measure
      of distance to a minimizer. At ``max_newton_gap`` the iterate is plainly not near one: 0.

    The recipe switches the first reading off by default (``hgms_max_grad_ratio``: with LoRA the
    adapter's gradient starts near 0 at B = 0 and grows by construction); ``inf`` switches any off.
    """
    def ramp(x: float, bad: float, good: float) -> float:
        if not math.isfinite(x):
            return 0.0
        if math.isinf(bad):  # that reading is switched off
            return 1.0
        return min(max((bad - x) / (bad - good), 0.0), 1.0)

    parts = {"trust_stationarity": ramp(grad_ratio, max_grad_ratio, 1.0),
             "trust_curvature": ramp(max(negative_curvature, 0.0), max_negative_curvature, 0.0),
             "trust_solve": ramp(solve_residual, max_solve_residual, 0.0),
             "trust_newton": ramp(max(newton_gap, 0.0), max_newton_gap, 0.0)}
    parts["trust"] = (parts["trust_stationarity"] * parts["trust_curvature"] * parts["trust_solve"]
                      * parts["trust_newton"])
    return parts


@dataclass
class Exp3:
    """ODM's EXP3 over K sources (rewards = training losses, importance weighted, EMA with ``decay``)."""

    k: int
    decay: float = 0.9
    rewards: list[float] = field(default_factory=list)
    t: int = 1

    def __post_init__(self):
        if not self.rewards:
            self.rewards = [0.0] * self.k

    def eps(self, t: int | None = None) -> float:
        t = max(self.t if t is None else t, 1)
        return min(1.0 / self.k, math.sqrt(math.log(self.k) / (self.k * t)))

    def probs(self) -> torch.Tensor:
        """pi_t = (1 - K eps_t) softmax(eps_{t-1} R) + eps_t."""
        e, e_prev = self.eps(self.t), self.eps(max(self.t - 1, 1))
        soft = torch.softmax(e_prev * torch.tensor(self.rewards, dtype=torch.float64), 0)
        return (1 - self.k * e) * soft + e

    def observe(self, counts: list[int], mean_losses: list[float]) -> torch.Tensor:
        """One round: source k contributed ``counts[k]`` examples with mean training loss ``mean_losses[k]``.

        The reward estimate of source k is (n_k / n) * loss_k / pi_k (unbiased for loss_k when the batch is
        drawn from pi); sources with no example get reward 0, i.e. their estimate decays.
        """
        pi = self.probs()
        n = max(sum(counts), 1)
        for i in range(self.k):
            r = (counts[i] / n) * mean_losses[i] / float(pi[i]) if counts[i] else 0.0
            self.rewards[i] = self.decay * self.rewards[i] + (1 - self.decay) * r
        self.t += 1
        return self.probs()

    def state(self) -> dict:
        return {"rewards": list(self.rewards), "t": self.t}

    def load(self, state: dict) -> None:
        self.rewards, self.t = list(state["rewards"]), int(state["t"])
