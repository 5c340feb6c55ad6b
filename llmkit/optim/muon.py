"""Muon and MuonLight: momentum orthogonalized by Newton-Schulz, for 2-D weight matrices.

Paper: "Sign-Based Optimizers Are Effective Under Heavy-Tailed Noise" (NeurIPS 2026),
which extends its SignSGD/Lion analysis to "Muon and Muonlight": Muon is the matrix analogue of a sign
method (it replaces the singular values of the momentum by 1, as SignSGD replaces coordinates by +-1), so
its step has a fixed spectral norm whatever the size of the gradient noise.

Algorithm (torch.optim.Muon, which this module builds on):

    B <- mu * B + G;   D = G + mu * B (Nesterov) or B
    O = NS_k(D)        ~ U V^T for D = U S V^T (k quintic Newton-Schulz steps, in bfloat16)
    W <- W * (1 - lr * wd);   W <- W - lr * scale(shape) * O

``Muon`` keeps Keller Jordan's shape scale ``sqrt(max(1, rows / cols))``: its learning rate lives on its own
scale (0.02 in the Muon speed runs), not AdamW's.

``MuonLight``: the abstract names "Muonlight" without defining it. We implement the Muon variant of
Moonshot's *Moonlight* model ("Muon is Scalable for LLM Training", Liu et al. 2025), the light-to-adopt
Muon: decoupled weight decay on by default and the update rescaled to AdamW's RMS,
``scale = 0.2 * sqrt(max(rows, cols))``, so it reuses AdamW's learning rate and weight decay unchanged
(no separate tuning) -- which is what a recipe switching ``optim`` wants. This is our reading; the update
direction (the orthogonalized momentum) is the same as Muon's, so the heavy-tail guarantees carry over.

Both accept only 2-D parameters (as torch.optim.Muon); embeddings, the LM head, norms and biases belong
to AdamW (``llmkit.optim.hf`` splits a model's parameters that way, as Muon's authors recommend).
"""

from __future__ import annotations

import torch

__all__ = ["Muon", "MuonLight", "newton_schulz"]


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with this project's defaults (no weight decay unless asked)."""

    def __init__(self, params, lr: float, momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.0,
                 nesterov: bool = True, adjust_lr_fn: str | None = "original", **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay,
                         nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **kwargs)


class MuonLight(torch.optim.Muon):
    """Moonlight's Muon: AdamW-matched update RMS (``0.2 sqrt(max(m, n))``) and decoupled weight decay,
    so ``lr`` and ``weight_decay`` are AdamW's."""

    def __init__(self, params, lr: float, momentum: float = 0.95, ns_steps: int = 5, weight_decay: float = 0.1,
                 nesterov: bool = True, **kwargs):
        kwargs.setdefault("adjust_lr_fn", "match_rms_adamw")
        super().__init__(params, lr=lr, momentum=momentum, ns_steps=ns_steps, weight_decay=weight_decay,
                         nesterov=nesterov, **kwargs)


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The orthogonalization Muon applies (torch's quintic Newton-Schulz), returned in ``g``'s dtype."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), steps, EPS).to(g.dtype)
