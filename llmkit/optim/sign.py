"""Sign-based optimizers (SignSGD / Signum, Lion) and a heavy-tail diagnostic for gradient noise.

Paper: "Sign-Based Optimizers Are Effective Under Heavy-Tailed Noise" (Yu, Tao, Wan, Luo, Zhang),
NeurIPS 2026. The paper gives convergence rates of SignSGD and Lion (and of
Muon / Muonlight, see ``muon.py``) under a generalized heavy-tailed noise condition: the stochastic gradient
noise may have only a finite p-th moment, p in (1, 2], so its variance can be infinite (as observed in LLM
training). A sign update has magnitude ``lr`` per coordinate whatever the size of the noise, which is why a
single huge noise sample cannot throw the iterate away, while SGD's step is proportional to it.

Algorithms (decoupled weight decay ``p <- p * (1 - lr * wd)`` before each update):

  SignSGD / Signum:  m <- beta * m + (1 - beta) * g   (m = g when momentum = 0)
                     p <- p - lr * sign(m)
  Lion:              u = sign(beta1 * m + (1 - beta1) * g);  p <- p - lr * u
                     m <- beta2 * m + (1 - beta2) * g

``Lion`` is lion-pytorch's implementation (the maintained one) under the signature this project uses.
What the paper adds beyond the update rules is the noise model; ``tail_index`` estimates it from samples of
gradient noise (Hill's estimator of the tail exponent alpha: moments of order p < alpha are finite, so
alpha < 2 means infinite variance, the regime where sign methods keep converging and SGD may not).

Deviations: none in the updates. The paper's analysis uses (mini-batch) step-size schedules; here the
step size is whatever the caller's scheduler sets.
"""

from __future__ import annotations

import torch
from lion_pytorch import Lion as _LionPytorch
from torch.optim import Optimizer

from ._closure import evaluate_closure

__all__ = ["Lion", "SignSGD", "tail_index"]


class SignSGD(Optimizer):
    """SignSGD (``momentum=0``) and Signum (``momentum=beta``): ``p <- p - lr * sign(EMA of gradients)``."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if beta > 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.detach().clone()
                    else:
                        state["momentum_buffer"].lerp_(g, 1.0 - beta)
                    g = state["momentum_buffer"]
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(torch.sign(g), alpha=-lr)
        return loss


class Lion(_LionPytorch):
    """Lion (Chen et al. 2023) from lion-pytorch: ``p <- p - lr * sign(beta1 m + (1 - beta1) g)``,
    then ``m <- beta2 m + (1 - beta2) g``; decoupled weight decay ``p <- p (1 - lr wd)``.
    Its authors suggest a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def tail_index(samples: torch.Tensor, fraction: float = 0.05) -> float:
    """Hill estimate of the tail exponent alpha of ``|samples|`` (e.g. minibatch gradient minus full gradient).

    Uses the largest ``fraction`` of the absolute values: alpha = 1 / mean(log(x_(i) / x_(k+1))). Moments of
    order p < alpha are finite; alpha < 2 is the infinite-variance (heavy-tailed) regime of the paper.
    Gaussian noise gives large values (> 3 for the default fraction), Student-t with df nu gives about nu.
    """
    x = samples.detach().abs().flatten().double()
    x = x[x > 0]
    if x.numel() < 20:
        raise ValueError("tail_index needs at least 20 non-zero samples")
    k = max(10, int(fraction * x.numel()))
    k = min(k, x.numel() - 1)
    top = torch.topk(x, k + 1).values
    return float(1.0 / torch.log(top[:k] / top[k]).mean())
