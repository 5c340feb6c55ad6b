"""Intrinsic Muon (iMuon): a norm-constrained LMO step on the tangent space of a matrix manifold, then a retraction.

Paper: "iMuon" (intrinsic Muon: Riemannian norm-constrained matrix optimization), NeurIPS 2026. Muon's step is the linear
maximization oracle (LMO) of a matrix-norm ball, taken in flat space. On a manifold, restricting that LMO to
the tangent space breaks quotient symmetries and has no closed form. The paper's fix: a Riemannian metric
lifts any unitarily invariant norm to an *intrinsic* norm on each tangent space (through a linear isometry
phi_X from the tangent space onto a plain matrix space), whose LMO is closed form:

    xi* = argmax_{||xi||_X <= 1} <grad f(X), xi>_X = phi_X^{-1}( lmo(phi_X(grad f(X))) )
    lmo(K) = U V^T (spectral),  K / ||K||_F (Frobenius),  top singular pair(s) (nuclear)
    X <- R_X(-lr * xi*)   (a retraction keeps the iterate on the manifold)

Per manifold (G is the Euclidean gradient):
  * ``stiefel`` (X^T X = I, n x p): canonical metric; tangent vectors are W X with W skew, and phi maps to
    W = G X^T - X G^T. The polar factor of a skew matrix is skew, so the spectral LMO is exact. Retraction:
    polar factor of X - lr W* X.
  * ``grassmann`` (span of an orthonormal X): horizontal space {xi: X^T xi = 0}; phi(xi) = xi is already an
    isometry onto matrices whose columns are orthogonal to X, and lmo keeps that property. Polar retraction.
  * ``spd`` (X symmetric positive definite): affine-invariant metric, phi(xi) = X^{-1/2} xi X^{-1/2}
    (symmetric), Riemannian gradient X sym(G) X, so phi(grad) = X^{1/2} sym(G) X^{1/2}. Retraction: the
    exponential map X^{1/2} expm(-lr S*) X^{1/2} (stays SPD exactly).
  * ``fixed_rank`` (rank-r matrices X = B A, stored as a factor pair, e.g. a LoRA adapter): embedded metric.
    With X = U S V^T, a tangent vector is xi = U Y^T + Z V^T with Z orthogonal to U, and
    phi(xi) = [Y; U_perp^T Z] is a linear isometry onto (n + m - r) x r matrices. Everything is computed
    from X alone (U, V from a thin SVD of the product via QR of the factors; the projected gradient from the
    factor gradients G_A = B^T G, G_B = G A^T), so the update of X does not depend on how it is factored:
    (B, A) and (B G, G^{-1} A) give the same new product. Retraction: truncated rank-r SVD of X - lr xi*
    (computed in factored form, rank <= 3r), re-factored as B = U sqrt(S), A = sqrt(S) V^T.
  * ``euclidean``: flat R^{m x n} (plain hidden matrices); the spectral LMO is Muon's orthogonalized step.

Momentum (``momentum`` > 0): an exponential sum of past steps' gradients transported to the current
tangent space by orthogonal projection (for fixed_rank the transported quantity is the previous tangent
momentum in factored form, so it too is factorization independent).

Deviations: exact SVD / eigendecompositions instead of Newton-Schulz (the manifolds here are small: LoRA
factors, subspaces); ``adjust_lr="match_rms_adamw"`` (Moonlight's 0.2 sqrt(max(m, n)) scale) is our addition
so recipes can share AdamW's learning rate. A fixed-rank point whose product is rank deficient (a LoRA pair
at initialization, B = 0) is not on the manifold: there each factor takes a Euclidean LMO step (not
factorization invariant) until the product reaches rank r.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import Optimizer

from ._closure import evaluate_closure

__all__ = ["MANIFOLDS", "NORMS", "IMuon", "imuon_lora_param_groups", "lmo"]

MANIFOLDS = ("stiefel", "grassmann", "spd", "fixed_rank", "euclidean")
NORMS = ("spectral", "frobenius", "nuclear")


# ---------------------------------------------------------------------------------------------- LMOs

def _keep(s: torch.Tensor, dtype) -> torch.Tensor:
    if s.numel() == 0 or s[0] <= 0:
        return torch.zeros_like(s, dtype=torch.bool)
    tol = s[0] * max(s.numel(), 1) * torch.finfo(dtype).eps * 10
    return s > tol


def _lmo_svd(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, norm: str) -> torch.Tensor:
    """lmo of u diag(s) vh (thin SVD, s descending)."""
    if norm == "frobenius":
        n = s.norm()
        return (u * (s / n)) @ vh if n > 0 else torch.zeros(u.shape[0], vh.shape[1], dtype=u.dtype, device=u.device)
    keep = _keep(s, u.dtype)
    if norm == "nuclear" and keep.any():
        keep = keep & (s >= s[0] * (1 - 1e-5))
    u, vh = u[:, keep], vh[keep]
    out = u @ vh
    return out / max(int(keep.sum()), 1) if norm == "nuclear" else out


def lmo(k: torch.Tensor, norm: str = "spectral") -> torch.Tensor:
    """argmax_{||D|| <= 1} <K, D> for a unitarily invariant norm (nuclear: the average of the top singular pairs,
    which keeps the symmetry of K: a skew K gives a skew D)."""
    if norm == "frobenius":
        n = k.norm()
        return k / n if n > 0 else torch.zeros_like(k)
    u, s, vh = torch.linalg.svd(k, full_matrices=False)
    return _lmo_svd(u, s, vh, norm)


def _lowrank_svd(left: torch.Tensor, right: torch.Tensor):
    """Thin SVD of left @ right.T without forming it (left m x k, right n x k)."""
    ql, rl = torch.linalg.qr(left)
    qr, rr = torch.linalg.qr(right)
    u, s, vh = torch.linalg.svd(rl @ rr.T)
    return ql @ u, s, vh @ qr.T


def _polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def _sym_lmo(s: torch.Tensor, norm: str) -> torch.Tensor:
    s = 0.5 * (s + s.T)
    if norm == "frobenius":
        n = s.norm()
        return s / n if n > 0 else torch.zeros_like(s)
    lam, q = torch.linalg.eigh(s)
    a = lam.abs()
    amax = a.max()
    if amax <= 0:
        return torch.zeros_like(s)
    keep = a > amax * s.shape[0] * torch.finfo(s.dtype).eps * 10
    if norm == "nuclear":
        keep = keep & (a >= amax * (1 - 1e-5))
    sign = torch.sign(lam) * keep
    out = (q * sign) @ q.T
    return out / max(int(keep.sum()), 1) if norm == "nuclear" else out


def _spd_sqrt(x: torch.Tensor):
    lam, q = torch.linalg.eigh(0.5 * (x + x.T))
    lam = lam.clamp_min(torch.finfo(x.dtype).tiny)
    return (q * lam.sqrt()) @ q.T


def _spd_exp(s: torch.Tensor):
    lam, q = torch.linalg.eigh(0.5 * (s + s.T))
    return (q * lam.exp()) @ q.T


# ---------------------------------------------------------------------------------------------- optimizer

class IMuon(Optimizer):
    """Intrinsic Muon. Each parameter is one point of ``manifold`` (for ``fixed_rank``: consecutive parameters
    of a group are pairs (B, A) with the point X = B @ A, as ``imuon_lora_param_groups`` builds them).

    Args: lr; manifold; norm (spectral | frobenius | nuclear); momentum (0 = none); weight_decay (euclidean
    only, decoupled); adjust_lr (None, or "match_rms_adamw": multiply lr by 0.2 sqrt(max(rows, cols)))."""

    def __init__(self, params, lr: float, manifold: str = "stiefel", norm: str = "spectral", momentum: float = 0.0,
                 weight_decay: float = 0.0, adjust_lr: str | None = None):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        defaults = {"lr": lr, "manifold": manifold, "norm": norm, "momentum": momentum,
                    "weight_decay": weight_decay, "adjust_lr": adjust_lr}
        super().__init__(params, defaults)
        for g in self.param_groups:
            if g["manifold"] not in MANIFOLDS:
                raise ValueError(f"manifold must be one of {', '.join(MANIFOLDS)}, got {g['manifold']!r}")
            if g["norm"] not in NORMS:
                raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {g['norm']!r}")
            if g["adjust_lr"] not in (None, "match_rms_adamw"):
                raise ValueError(f"adjust_lr must be None or 'match_rms_adamw', got {g['adjust_lr']!r}")
            if not 0.0 <= g["momentum"] < 1.0:
                raise ValueError(f"momentum must be in [0, 1), got {g['momentum']}")
            ps = g["params"]
            if any(p.ndim != 2 for p in ps):
                raise ValueError("IMuon parameters must be matrices (2-D)")
            if g["manifold"] == "fixed_rank":
                if len(ps) % 2:
                    raise ValueError("fixed_rank groups hold pairs (B, A): an even number of parameters")
                for b, a in zip(ps[0::2], ps[1::2]):
                    if b.shape[1] != a.shape[0]:
                        raise ValueError(f"fixed_rank pair shapes do not chain: B {tuple(b.shape)}, A {tuple(a.shape)}")
            if g["manifold"] == "spd" and any(p.shape[0] != p.shape[1] for p in ps):
                raise ValueError("spd parameters must be square")

    @staticmethod
    def _lr(group, shape) -> float:
        if group["adjust_lr"] == "match_rms_adamw":
            return group["lr"] * 0.2 * math.sqrt(max(shape))
        return group["lr"]

    def _momentum(self, p, g, mu):
        if mu <= 0:
            return g
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = g.clone()
        else:
            st["momentum_buffer"].mul_(mu).add_(g)
        return st["momentum_buffer"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            man, norm, mu = group["manifold"], group["norm"], group["momentum"]
            if man == "fixed_rank":
                ps = group["params"]
                for b, a in zip(ps[0::2], ps[1::2]):
                    if b.grad is not None or a.grad is not None:
                        self._fixed_rank_step(b, a, group)
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                x = p.detach()
                dtype = x.dtype
                xw = x.double() if dtype in (torch.float16, torch.bfloat16) else x
                g = self._momentum(p, p.grad.to(xw.dtype), mu)
                lr = self._lr(group, x.shape)
                if man == "euclidean":
                    if group["weight_decay"]:
                        xw = xw * (1 - group["lr"] * group["weight_decay"])
                    new = xw - lr * lmo(g, norm)
                elif man == "grassmann":
                    flip = xw.shape[0] < xw.shape[1]
                    xo, go = (xw.T, g.T) if flip else (xw, g)
                    h = go - xo @ (xo.T @ go)
                    new = _polar(xo - lr * lmo(h, norm))
                    new = new.T if flip else new
                elif man == "stiefel":
                    flip = xw.shape[0] < xw.shape[1]
                    xo, go = (xw.T, g.T) if flip else (xw, g)
                    # W = G X^T - X G^T = [G, X] [X, -G]^T, rank <= 2p: its LMO from a factored SVD
                    u, s, vh = _lowrank_svd(torch.cat([go, xo], 1), torch.cat([xo, -go], 1))
                    w = _lmo_svd(u, s, vh, norm)
                    new = _polar(xo - lr * (w @ xo))
                    new = new.T if flip else new
                else:  # spd
                    half = _spd_sqrt(xw)
                    sg = half @ (0.5 * (g + g.T)) @ half
                    new = half @ _spd_exp(-lr * _sym_lmo(sg, norm)) @ half
                    new = 0.5 * (new + new.T)
                p.copy_(new.to(dtype))
        return loss

    def _fixed_rank_step(self, b: torch.Tensor, a: torch.Tensor, group) -> None:
        norm, mu = group["norm"], group["momentum"]
        dtype = b.dtype
        wd = torch.float64 if dtype in (torch.float16, torch.bfloat16) else dtype
        bw, aw = b.detach().to(wd), a.detach().to(wd)
        gb = b.grad.to(wd) if b.grad is not None else torch.zeros_like(bw)
        ga = a.grad.to(wd) if a.grad is not None else torch.zeros_like(aw)
        r = bw.shape[1]
        lr = self._lr(group, (bw.shape[0], aw.shape[1]))
        qb, rb = torch.linalg.qr(bw)
        qa, ra = torch.linalg.qr(aw.T)
        u0, s0, vh0 = torch.linalg.svd(rb @ ra.T)
        tiny = torch.finfo(wd).eps * 100
        if s0.numel() < r or s0[0] <= 0 or s0[-1] <= tiny * s0[0]:
            # rank-deficient product (e.g. LoRA's B = 0 at init): a Euclidean LMO step on each factor
            b.copy_((bw - lr * lmo(gb, norm)).to(dtype))
            a.copy_((aw - lr * lmo(ga, norm)).to(dtype))
            self.state[b].pop("tangent_momentum", None)
            return
        uu = qb @ u0  # m x r, orthonormal basis of col(X)
        vv = qa @ vh0.T  # n x r, of row(X)
        # Y = G^T U = G_A^T Rb^{-1} u0 ;  G V = G_B Ra^{-1} vh0^T
        y = ga.T @ torch.linalg.solve_triangular(rb, u0, upper=True)
        gv = gb @ torch.linalg.solve_triangular(ra, vh0.T, upper=True)
        z = gv - uu @ (uu.T @ gv)
        if mu > 0:
            st = self.state[b]
            prev = st.get("tangent_momentum")
            if prev is not None:  # project the previous tangent momentum L R^T onto the current tangent space
                lft, rgt = prev
                y = y + mu * (rgt @ (lft.T @ uu))
                zm = lft @ (rgt.T @ vv)
                z = z + mu * (zm - uu @ (uu.T @ zm))
            st["tangent_momentum"] = (torch.cat([uu, z], 1), torch.cat([y, vv], 1))
        k = lmo(torch.cat([y, z], 0), norm)
        y2, z2 = k[: y.shape[0]], k[y.shape[0]:]
        # X - lr xi = [B, -lr U, -lr Z'] [A^T, Y', V]^T
        un, sn, vhn = _lowrank_svd(torch.cat([bw, -lr * uu, -lr * z2], 1), torch.cat([aw.T, y2, vv], 1))
        root = sn[:r].clamp_min(0).sqrt()
        b.copy_((un[:, :r] * root).to(dtype))
        a.copy_((root[:, None] * vhn[:r]).to(dtype))


def imuon_lora_param_groups(model: nn.Module, **options) -> list[dict]:
    """One ``fixed_rank`` group per trainable LoRA adapter pair: ``{"params": [B, A], "manifold": "fixed_rank"}``
    (peft's ``lora_B[name].weight`` is out x r, ``lora_A[name].weight`` r x in; the point is X = B @ A).
    ``options`` (norm, momentum, lr ...) are copied into every group."""
    groups = []
    for module in model.modules():
        la, lb = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(la, nn.ModuleDict) or not isinstance(lb, nn.ModuleDict):
            continue
        for key in la:
            if key not in lb:
                continue
            a, b = getattr(la[key], "weight", None), getattr(lb[key], "weight", None)
            if a is None or b is None or a.ndim != 2 or b.ndim != 2:
                continue
            if a.requires_grad and b.requires_grad:
                groups.append({"params": [b, a], "manifold": "fixed_rank", **options})
    return groups
