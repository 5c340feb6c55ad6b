"""Optimistic bilevel hypergradients: a pseudoinverse Hessian restricted to its range, plus optimistic selection.

Paper: HG-MS (optimistic bilevel optimization with non-isolated lower-level minimizers, NeurIPS 2026). With x
the upper variable (e.g. data-source weights) and y the lower one (model parameters, or a subset)::

    min_x  F(x) = min_{y in S(x)} f(x, y),      S(x) = argmin_y g(x, y)            (optimistic)

When S(x) is a manifold of minimizers H = d2g/dy2 is singular and the implicit-function hypergradient does not
exist. Under a local PL condition F is differentiable where y*(x) = argmin_{y in S(x)} f(x, y) is unique, and::

    grad F(x) = d_x f(x, y*) - d2g/dxdy(x, y*) . H(x, y*)^+ . d_y f(x, y*)

(at y*, d_y f is orthogonal to ker H, the tangent space of S(x), so it lies in range(H) where H^+ is the right
inverse). HG-MS is select-then-differentiate: move y along S(x) to the selection, then apply it.

What this module computes, from Hessian-vector products only (any list of tensors, any scalar closures):
* ``lanczos(matvec, b, iters)``: Lanczos with full reorthogonalisation on K(H, b), one HVP per step.
* ``pinv_solve(matvec, b, iters, rtol)``: H^+ b on the Ritz pairs of H kept (theta_i > rtol * max theta, and
  positive by default), with the Ritz residuals and the solve's relative residual (free from the Lanczos
  relation): exact when iters >= rank + 1; truncated, the vector of least true residual in the kept Ritz span
  (MINRES restricted to it: ``solve_residual`` <= 1, where the Galerkin sum u_i c_i / theta_i can exceed 1).
* ``flat_directions(matvec, d, iters, flat_rtol, probes)``: certified near-null directions of H: each probe
  runs Lanczos from a fresh random vector (orthogonal to those found) and accepts its Ritz vector of least
  ||H u|| (exact: ||H u||^2 = theta^2 + residual^2) if ||H u|| <= flat_rtol * max curvature seen.
* ``hypergradient(inner_loss, outer_loss, params, hparams)``: the formula at the current y, in 2 forwards, 2
  backwards (g's with ``create_graph``), iters + 1 double-backwards; also d_y g and (``flat_probes``) flat directions.
* ``optimistic_select(...)``: ``steps`` iterations of y <- y - lr * P_flat d_y f (P_flat the projector on the
  certified flat directions), each optionally followed by ``retract_steps`` gradient steps on g (back to S(x)
  when it is curved); ``hgms_step`` = ``optimistic_select`` then ``hypergradient``.

Selection starts Lanczos from random vectors, not from d_y f: d_y f off the kept Ritz directions is flat only
once Krylov has captured range(H); with an LLM's few iterations it is mostly unreached curvature. Certified
directions are flat, and none certified: no move.

Deviations: the exact selection is nonconvex over S(x); we take a few projected descent steps, each in the span
of the certified flat directions (randomized subspace descent: a local improvement, not the argmin). Away from
a minimizer H may be indefinite; negative Ritz values are dropped (``drop_negative=True``). Ritz values below
``rtol * theta_max`` count as zero, which makes the inverse a pseudoinverse (norm <= 1 / (rtol * theta_max)).
Truncated, the solve is minimal-residual, not Galerkin: an unconverged small kept Ritz value would multiply its
error by 1 / theta.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Tensors = Sequence[torch.Tensor]


def flatten(ts: Tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.zeros(0)


def unflatten(vec: torch.Tensor, like: Tensors) -> list[torch.Tensor]:
    out, i = [], 0
    for t in like:
        n = t.numel()
        out.append(vec[i:i + n].view_as(t).to(t.dtype))
        i += n
    return out


def _grads(loss: torch.Tensor, params: Tensors, **kw) -> list[torch.Tensor]:
    gs = torch.autograd.grad(loss, list(params), allow_unused=True, **kw)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]


class HVP:
    """Hessian-vector products of ``loss`` w.r.t. ``params``: one create-graph backward, then a double
    backward per product through the retained gradient graph (no new forward)."""

    def __init__(self, loss: torch.Tensor, params: Tensors):
        self.params = list(params)
        self.grads = _grads(loss, self.params, create_graph=True)
        self.count = 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        self.count += 1
        vs = unflatten(v, self.params)
        dot = sum((g * u).sum() for g, u in zip(self.grads, vs) if g.requires_grad)
        if not torch.is_tensor(dot) or not dot.requires_grad:  # g is linear in nothing: H = 0
            return torch.zeros_like(v)
        return flatten(_grads(dot, self.params, retain_graph=True))


def lanczos(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iters: int,
            breakdown: float = 1e-10, *, return_residual: bool = False):
    """Lanczos on K(H, b) with full reorthogonalisation: returns (Q [k, d] orthonormal rows, T [k, k]).

    With ``return_residual=True`` also the norm beta of the next Lanczos vector, which prices every
    Ritz pair for free: H Q^T = Q^T T + beta q_next e_k^T, so for a Ritz pair (theta, u = S[:, i]^T Q),
    ||H u - theta u|| = beta |S[k-1, i]| (0 when the Krylov space is invariant).
    """
    dtype = b.dtype
    b = b.detach().double()
    nb = b.norm()
    if nb == 0 or iters < 1:
        out = b.new_zeros(0, b.numel()), b.new_zeros(0, 0)
        return (*out, b.new_zeros(())) if return_residual else out
    qs = [b / nb]
    alphas, betas = [], []
    last = b.new_zeros(())
    for j in range(iters):
        w = matvec(qs[j].to(dtype)).detach().double()
        a = torch.dot(w, qs[j])
        alphas.append(a)
        Q = torch.stack(qs)
        for _ in range(2):  # twice is enough (Kahan)
            w = w - Q.T @ (Q @ w)
        beta = w.norm()
        if beta <= breakdown * max(nb, 1.0) or beta <= breakdown * abs(a):
            last = b.new_zeros(())  # invariant subspace: the Ritz pairs are exact
            break
        last = beta
        if j == iters - 1:
            break
        betas.append(beta)
        qs.append(w / beta)
    k = len(alphas)
    T = torch.diag(torch.stack(alphas))
    if k > 1:
        off = torch.stack(betas[:k - 1])
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    return (torch.stack(qs[:k]), T, last) if return_residual else (torch.stack(qs[:k]), T)


@dataclass
class PinvResult:
    solution: torch.Tensor        # H^+ b on the kept spectrum (flat, b's dtype)
    null_part: torch.Tensor       # b minus its projection on the kept Ritz directions (NOT a flat direction
    #                               in the truncated regime: it also holds the curvature Lanczos has not found)
    ritz_values: torch.Tensor     # all Ritz values found (float64)
    kept: int                     # how many were inverted
    matvecs: int                  # HVPs spent
    ritz_residuals: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    solve_residual: float = 0.0   # ||H x - P_kept b|| / ||P_kept b||: how well the Krylov model solved its part
    kept_vectors: torch.Tensor | None = None   # the kept Ritz vectors [kept, d] (float64), for ``apply``
    kept_values: torch.Tensor | None = None

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        """The same truncated pseudoinverse applied to another vector (no HVP): sum_kept u_i (u_i . v) / theta_i."""
        if self.kept_vectors is None or self.kept_vectors.shape[0] == 0:
            return torch.zeros_like(v)
        c = self.kept_vectors @ v.detach().double().to(self.kept_vectors.device)
        return (self.kept_vectors.T @ (c / self.kept_values)).to(device=v.device, dtype=v.dtype)


def pinv_solve(matvec: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, iters: int = 20,
               rtol: float = 1e-4, drop_negative: bool = True, minimal_residual: bool = True) -> PinvResult:
    """Truncated-Lanczos pseudoinverse: H^+ b with Ritz values <= rtol * max dropped (see module docstring).

    ``minimal_residual`` (default): the solution in the span of the kept Ritz vectors with the least true
    residual ||H x - P_kept b|| (MINRES's choice, restricted to that span), so ``solve_residual`` <= 1, with 1
    meaning no better than x = 0; ``False``: the plain Galerkin pseudoinverse sum_kept u_i c_i / theta_i,
    whose residual can exceed 1 when a small kept Ritz value has not converged (it is amplified by 1/theta).
    Both are H^+ b when Krylov has reached an invariant subspace."""
    count = [0]

    def mv(v):
        count[0] += 1
        return matvec(v)

    Q, T, beta = lanczos(mv, b, iters, return_residual=True)
    bd = b.detach().double()
    if Q.shape[0] == 0:
        return PinvResult(torch.zeros_like(b), b.detach().clone(), torch.zeros(0, dtype=torch.float64), 0, count[0])
    theta, S = torch.linalg.eigh(T)
    U = S.T @ Q                       # Ritz vectors as rows
    scale = theta.abs().max()
    keep = theta > rtol * scale if drop_negative else theta.abs() > rtol * scale
    coef = U[keep] @ bd
    null = bd - U[keep].T @ coef
    # x = U_kept^T y: H x - P_kept b = U_kept^T (Theta y - c) + beta q_next (s . y) (the Lanczos relation, no
    # extra HVP), so the y of least residual solves (Theta^2 + beta^2 s s^T) y = Theta c: Theta^-1 c (the
    # pseudoinverse) once Krylov is invariant (beta = 0), and damped along unconverged Ritz pairs before that.
    th, s = theta[keep], S[-1, keep]
    if minimal_residual and keep.any():
        y = torch.linalg.solve(torch.diag(th ** 2) + beta ** 2 * torch.outer(s, s), th * coef)
    else:
        y = coef / th
    resid = torch.sqrt(((th * y - coef) ** 2).sum() + (beta * (s @ y)) ** 2)
    resid = float(resid / coef.norm().clamp_min(1e-300))
    sol = U[keep].T @ y
    return PinvResult(sol.to(b.dtype), null.to(b.dtype), theta, int(keep.sum()), count[0],
                      ritz_residuals=beta * S[-1].abs(), solve_residual=resid if keep.any() else 0.0,
                      kept_vectors=U[keep], kept_values=theta[keep])


@dataclass
class FlatResult:
    basis: torch.Tensor           # [m, d] orthonormal rows (float64): directions u with ||H u|| <= flat_rtol * scale
    ritz_values: torch.Tensor     # theta of each accepted direction
    hu_norms: torch.Tensor        # ||H u|| of each (exact from the Lanczos relation: sqrt(theta^2 + residual^2))
    scale: float                  # largest |Ritz value| seen: the curvature the tolerance is relative to
    matvecs: int

    def project(self, v: torch.Tensor) -> torch.Tensor:
        """The part of ``v`` in the certified flat subspace (zero when none was found)."""
        if self.basis.shape[0] == 0:
            return torch.zeros_like(v)
        vd = v.detach().double().to(self.basis.device)
        return (self.basis.T @ (self.basis @ vd)).to(device=v.device, dtype=v.dtype)


def flat_directions(matvec: Callable[[torch.Tensor], torch.Tensor], dim: int, *, iters: int = 20,
                    flat_rtol: float = 1e-4, probes: int = 1, generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32, device=None) -> FlatResult:
    """Near-null directions of H, certified: ``probes`` Lanczos runs, each from a fresh random vector.

    A Krylov space K(H, v) meets the null space of H only in the line of P_0 v (every H^j v, j >= 1,
    lies in range(H)), so each run can contribute at most one exactly flat direction: its Ritz vector
    of smallest curvature, accepted only if ||H u|| <= flat_rtol * (largest Ritz value seen). Each start
    is orthogonalised against the directions already accepted, so p probes find up to p orthogonal
    ones. In the truncated regime (iters <= rank of H) nothing may pass: then the step stays put rather
    than move along a direction that has curvature.
    """
    basis: list[torch.Tensor] = []
    thetas, hus = [], []
    scale, used = 0.0, 0
    for _ in range(probes):
        v = torch.randn(dim, generator=generator, dtype=torch.float64)
        if basis:
            B = torch.stack(basis)
            for _ in range(2):
                v = v - B.T @ (B @ v)
        Q, T, beta = lanczos(lambda x: matvec(x.to(device=device)), v.to(dtype), iters, return_residual=True)
        used += Q.shape[0]  # one HVP per Lanczos vector
        if Q.shape[0] == 0:
            continue
        theta, S = torch.linalg.eigh(T)
        scale = max(scale, float(theta.abs().max()))
        hu = torch.sqrt(theta ** 2 + (beta * S[-1]) ** 2)
        i = int(hu.argmin())
        if scale > 0 and float(hu[i]) <= flat_rtol * scale:
            u = S[:, i] @ Q
            if basis:
                B = torch.stack(basis)
                u = u - B.T @ (B @ u)
            if u.norm() > 0.5:  # not a direction already accepted
                basis.append(u / u.norm())
                thetas.append(theta[i])
                hus.append(hu[i])
    if not basis:
        z = torch.zeros(0, dtype=torch.float64)
        return FlatResult(torch.zeros(0, dim, dtype=torch.float64), z, z, scale, used)
    return FlatResult(torch.stack(basis), torch.stack(thetas), torch.stack(hus), scale, used)


@dataclass
class HyperGradient:
    grads: list[torch.Tensor]     # dF/dhparam, one per hparam
    outer_loss: float
    outer_grad: torch.Tensor      # d_y f (flat)
    solve: PinvResult             # the pseudoinverse solve (solution = H^+ d_y f)
    passes: dict[str, int] = field(default_factory=dict)
    inner_grad: torch.Tensor | None = None   # d_y g (flat, detached): how far from stationary the inner problem is
    inner_loss: float | None = None
    flat: FlatResult | None = None           # with flat_probes > 0: certified flat directions of H at this point


def hypergradient(inner_loss: Callable[[], torch.Tensor], outer_loss: Callable[[], torch.Tensor],
                  params: Tensors, hparams: Tensors, *, iters: int = 20, rtol: float = 1e-4,
                  drop_negative: bool = True, flat_probes: int = 0, flat_rtol: float | None = None,
                  generator: torch.Generator | None = None) -> HyperGradient:
    """grad F(x) = d_x f - d2g/dxdy H^+ d_y f at the current ``params`` (call after selection).

    ``inner_loss()`` and ``outer_loss()`` are closures returning scalars that depend on ``params`` (the
    lower variable y, any subset of a model's tensors, each requiring grad) and ``hparams`` (x, tensors
    requiring grad). Nothing is modified. ``flat_probes > 0`` also runs ``flat_directions`` on the same
    retained gradient graph (``flat_probes * iters`` more HVPs, no new forward): the selection direction
    for the next step is ``result.flat.project(result.outer_grad)``.
    """
    params, hparams = list(params), list(hparams)
    f = outer_loss()
    fg = _grads(f, params + hparams)
    dy_f, dx_f = flatten(fg[:len(params)]), fg[len(params):]
    g = inner_loss()
    hvp = HVP(g, params)
    solve = pinv_solve(hvp, dy_f, iters=iters, rtol=rtol, drop_negative=drop_negative)
    flat = None
    if flat_probes > 0:
        flat = flat_directions(hvp, dy_f.numel(), iters=iters, flat_rtol=rtol if flat_rtol is None else flat_rtol,
                               probes=flat_probes, generator=generator, dtype=dy_f.dtype, device=dy_f.device)
    q = unflatten(solve.solution.to(dy_f.device), params)
    mixed_dot = sum((gi * qi).sum() for gi, qi in zip(hvp.grads, q) if gi.requires_grad)
    if torch.is_tensor(mixed_dot) and mixed_dot.requires_grad:
        mixed = _grads(mixed_dot, hparams)
    else:
        mixed = [torch.zeros_like(h) for h in hparams]
    grads = [a.detach() - m.detach() for a, m in zip(dx_f, mixed)]
    passes = {"forward": 2, "backward": 2, "double_backward": hvp.count + 1}
    return HyperGradient(grads, float(f.detach()), dy_f.detach(), solve, passes,
                         inner_grad=flatten([gi.detach() for gi in hvp.grads]), inner_loss=float(g.detach()),
                         flat=flat)


@dataclass
class SelectResult:
    outer_losses: list[float]     # f before each step and at the end
    passes: dict[str, int]
    flat_dims: list[int] = field(default_factory=list)   # certified flat directions found at each step


def optimistic_select(inner_loss: Callable[[], torch.Tensor], outer_loss: Callable[[], torch.Tensor],
                      params: Tensors, *, steps: int = 10, lr: float = 0.1, iters: int = 20, rtol: float = 1e-4,
                      drop_negative: bool = True, retract_steps: int = 0, retract_lr: float = 0.1,
                      probes: int = 1, flat_rtol: float | None = None,
                      generator: torch.Generator | None = None) -> SelectResult:
    """Move ``params`` (in place) along the flat directions of g toward lower f: the optimistic selection.

    Each step: ``flat_directions`` of H = d2g/dy2 from ``probes`` random starts (``iters`` HVPs each;
    directions with ||H u|| <= flat_rtol * max curvature, default ``rtol``), then
    y <- y - lr * P_flat d_y f (g does not change to second order), then ``retract_steps`` plain gradient
    steps on g (back onto S(x) if it is curved). A step that certifies no flat direction does not move.
    ``drop_negative`` is accepted for compatibility; the selection inverts nothing.
    """
    params = list(params)
    losses: list[float] = []
    dims: list[int] = []
    passes = {"forward": 0, "backward": 0, "double_backward": 0}
    for _ in range(steps):
        f = outer_loss()
        dy_f = flatten(_grads(f, params))
        losses.append(float(f.detach()))
        hvp = HVP(inner_loss(), params)
        flat = flat_directions(hvp, dy_f.numel(), iters=iters, flat_rtol=rtol if flat_rtol is None else flat_rtol,
                               probes=probes, generator=generator, dtype=dy_f.dtype, device=dy_f.device)
        dims.append(int(flat.basis.shape[0]))
        passes["forward"] += 2
        passes["backward"] += 2
        passes["double_backward"] += hvp.count
        with torch.no_grad():
            for p, d in zip(params, unflatten(flat.project(dy_f), params)):
                p.sub_(lr * d)
        for _ in range(retract_steps):
            gr = _grads(inner_loss(), params)
            passes["forward"] += 1
            passes["backward"] += 1
            with torch.no_grad():
                for p, d in zip(params, gr):
                    p.sub_(retract_lr * d)
    losses.append(float(outer_loss().detach()))
    passes["forward"] += 1
    return SelectResult(losses, passes, dims)


def hgms_step(inner_loss: Callable[[], torch.Tensor], outer_loss: Callable[[], torch.Tensor], params: Tensors,
              hparams: Tensors, *, select_steps: int = 10, select_lr: float = 0.1, iters: int = 20,
              rtol: float = 1e-4, drop_negative: bool = True, retract_steps: int = 0,
              retract_lr: float = 0.1, probes: int = 1, flat_rtol: float | None = None,
              generator: torch.Generator | None = None) -> tuple[HyperGradient, SelectResult]:
    """HG-MS: optimistic selection (moves ``params``), then the pseudoinverse hypergradient there."""
    sel = optimistic_select(inner_loss, outer_loss, params, steps=select_steps, lr=select_lr, iters=iters,
                            rtol=rtol, drop_negative=drop_negative, retract_steps=retract_steps,
                            retract_lr=retract_lr, probes=probes, flat_rtol=flat_rtol, generator=generator)
    hg = hypergradient(inner_loss, outer_loss, params, hparams, iters=iters, rtol=rtol,
                       drop_negative=drop_negative)
    return hg, sel


__all__ = ["HVP", "FlatResult", "HyperGradient", "PinvResult", "SelectResult", "flat_directions", "flatten",
           "hgms_step", "hypergradient", "lanczos", "optimistic_select", "pinv_solve", "unflatten"]
