"""LOCU: multi-constraint policy steps by Löwdin orthogonalization under the Fisher-Rao metric.

Paper: "LOCU: Löwdin orthogonalization for multi-constraint policy optimization" (NeurIPS 2026): multi-constraint policy optimization in CMDPs, where
interacting constraint gradients make update directions ill-conditioned. LOCU applies symmetric Löwdin
orthogonalization to the natural gradients of the reward and the constraints under the Fisher-Rao metric; with
Fisher-geometric screening and near-collinear compression this gives a small reduced space in which the trust
region is a Euclidean ball and the constraints are handled by a low-dimensional active-set solve. Infeasible
iterates take a Pareto-descent direction that lowers every violated constraint and keeps satisfied ones satisfied.

The step solved here (one policy update, linearised as in CPO):

    maximise  g^T s   subject to   c_i + b_i^T s <= 0  (i = 1..m),   s^T F s <= delta^2

1. **Natural gradients and their Gram matrix.** ``U = [g; b_1; ...; b_m]``, ``K = U F^{-1} U^T``. Everything
   below works on ``K`` (size m+1): m+1 solves with F (none when ``fisher`` is None: F = I).
2. **Fisher-geometric screening.** Within the trust region constraint i moves by at most ``delta sqrt(K_ii)``;
   one with ``c_i + delta sqrt(K_ii) < 0`` cannot become active, and one with (numerically) zero Fisher norm
   cannot be moved: both are dropped (reported in ``info``).
3. **Near-collinear compression.** Constraints whose natural gradients have Fisher cosine above
   ``1 - collinear_tol`` form a group that keeps its most restrictive member (largest ``c_i / sqrt(K_ii)``).
   Nearly parallel rows are what make ``(B F^{-1} B^T)^{-1}`` explode in a naive projection.
4. **Löwdin orthogonalization.** ``K = E diag(lam) E^T``; the symmetric basis ``Q = F^{-1} U^T E lam^{-1/2} E^T``
   is F-orthonormal and, among the orthonormal bases of the span, the closest to the natural gradients, so
   the reward and every constraint are treated symmetrically. Eigenvalues below ``rank_tol * max(lam)`` are
   dropped. The optimum lies in this span (KKT), and with ``s = Q z`` the trust region is ``||z|| <= delta``.
5. **Active-set solve.** The reduced problem ``max a^T z, ||z|| <= delta, h_i^T z <= -c_i`` has a closed-form
   maximiser per face (active set, ball active or not); all faces are enumerated (exact) up to
   ``max_enumerate`` constraints after screening, beyond that scipy's SLSQP solves the same small problem.
6. **Infeasible iterates.** With no common point in the ball, the step is the Pareto-descent direction: the
   negative min-norm point of the convex hull of the violated constraints' unit normals (MGDA); a satisfied
   constraint that it would break joins the set until none breaks. Its length is the smallest that satisfies
   every violated linearisation, capped at ``delta``.

Deviations: the abstract gives no formulas, so steps 2-6 are our first-principles reading of it. Compression
keeps one representative per near-collinear group, so the other members are honoured only up to the angle
between them (O(sqrt(collinear_tol) * delta)). The final step is rescaled if rounding puts it outside the
trust region, so ``s^T F s <= delta^2`` always holds. ``naive_projection_step`` is the ill-conditioned
baseline the paper argues against (projection through ``(B F^{-1} B^T)^{-1}``), kept for tests and benches.
For a model's parameters (identity Fisher, d too large for float64 copies) ``locu_step_in_span`` solves the same
step in the span's coordinates and ``locu_constrained_step`` writes it into ``.grad`` (VSPO's ``locu``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["LocuInfo", "flat_grads", "locu_constrained_step", "locu_step", "locu_step_in_span",
           "naive_projection_step"]


@dataclass
class LocuInfo:
    """What one ``locu_step`` did (returned with ``return_info=True``)."""

    mode: str = "optimize"                      # optimize | recover (Pareto descent) | stationary
    kept: list[int] = field(default_factory=list)        # constraints in the reduced problem
    screened: list[int] = field(default_factory=list)    # dropped: cannot become active in the trust region
    immovable: list[int] = field(default_factory=list)   # dropped: zero Fisher-norm gradient
    merged: dict[int, list[int]] = field(default_factory=dict)  # representative -> near-collinear members
    reduced_dim: int = 0
    predicted_values: list[float] = field(default_factory=list)  # c_i + b_i^T s for every constraint
    fisher_norm_sq: float = 0.0                # s^T F s
    reward_gain: float = 0.0                   # g^T s


def _natural(U: torch.Tensor, fisher: torch.Tensor | None, damping: float) -> torch.Tensor:
    """Rows F^{-1} u for each row u of U (float64)."""
    if fisher is None:
        return U
    F = fisher.to(torch.float64)
    d = F.shape[0]
    if F.shape != (d, d) or U.shape[1] != d:
        raise ValueError(f"fisher must be [d, d] with d={U.shape[1]}, got {tuple(fisher.shape)}")
    F = 0.5 * (F + F.T)
    scale = float(F.diagonal().abs().mean()) or 1.0
    eye = torch.eye(d, dtype=F.dtype, device=F.device)
    L, bad = torch.linalg.cholesky_ex(F + damping * scale * eye)
    if int(bad) == 0:
        return torch.cholesky_solve(U.T, L).T
    return (torch.linalg.pinv(F + damping * scale * eye, hermitian=True) @ U.T).T


def _solve_ball_polytope(a: np.ndarray, H: np.ndarray, b: np.ndarray, delta: float, *,
                         max_enumerate: int, tol: float) -> np.ndarray | None:
    """max a^T z s.t. ||z|| <= delta, H z <= b. Returns None when the set is empty."""
    r = a.shape[0]
    k = H.shape[0]
    scale = max(delta, 1e-300)
    feas_tol = tol * (1.0 + np.abs(b).max(initial=0.0) + np.linalg.norm(H, axis=1).max(initial=0.0) * scale)
    if k > max_enumerate:
        return _solve_slsqp(a, H, b, delta, feas_tol)
    best, best_val = None, -np.inf
    for size in range(min(k, r) + 1):
        for A in itertools.combinations(range(k), size):
            HA, bA = H[list(A)], b[list(A)]
            if size:
                pinv = np.linalg.pinv(HA, rcond=1e-10)
                z0 = pinv @ bA
                if np.linalg.norm(HA @ z0 - bA) > feas_tol:
                    continue  # inconsistent equalities
                pa = a - pinv @ (HA @ a)
            else:
                z0 = np.zeros(r)
                pa = a.copy()
            n0 = np.linalg.norm(z0)
            if n0 > delta * (1 + 1e-12) + feas_tol:
                continue
            npa = np.linalg.norm(pa)
            if npa > 1e-14 * (1.0 + np.linalg.norm(a)):
                z = z0 + np.sqrt(max(delta ** 2 - n0 ** 2, 0.0)) * pa / npa
            else:
                z = z0
            if k and np.any(H @ z - b > feas_tol):
                continue
            val = float(a @ z)
            if val > best_val + 1e-15 * (1 + abs(best_val) if np.isfinite(best_val) else 1):
                best, best_val = z, val
    return best


def _solve_slsqp(a, H, b, delta, feas_tol):
    from scipy.optimize import minimize

    r = a.shape[0]
    cons = [{"type": "ineq", "fun": lambda z: b - H @ z, "jac": lambda z: -H},
            {"type": "ineq", "fun": lambda z: np.array([delta ** 2 - z @ z]), "jac": lambda z: -2 * z[None]}]
    res = minimize(lambda z: -(a @ z), np.zeros(r), jac=lambda z: -a, constraints=cons, method="SLSQP",
                   options={"maxiter": 500, "ftol": 1e-12})
    z = res.x
    if np.any(H @ z - b > 10 * feas_tol) or z @ z > delta ** 2 * (1 + 1e-6):
        return None
    return z


def _min_norm_in_hull(N: np.ndarray) -> np.ndarray:
    """Min-norm point of the convex hull of the rows of N (small; NNLS with a heavily weighted sum-to-one row)."""
    from scipy.optimize import nnls

    k = N.shape[0]
    if k == 1:
        return N[0].copy()
    rho = 1e3 * (1.0 + np.abs(N).max())
    A = np.vstack([N.T, rho * np.ones((1, k))])
    rhs = np.concatenate([np.zeros(N.shape[1]), [rho]])
    w, _ = nnls(A, rhs, maxiter=50 * k)
    w = np.maximum(w, 0)
    w = w / w.sum() if w.sum() > 0 else np.full(k, 1.0 / k)
    return w @ N


def _pareto_descent(H: np.ndarray, c: np.ndarray, delta: float, tol: float) -> np.ndarray | None:
    """Reduced-space Pareto-descent step for an infeasible iterate (c has positive entries)."""
    norms = np.linalg.norm(H, axis=1)
    active = set(np.flatnonzero(c > 0).tolist())
    z = np.zeros(H.shape[1])
    for _ in range(H.shape[0] + 1):
        idx = sorted(active)
        u = _min_norm_in_hull(H[idx] / norms[idx, None])
        nu = np.linalg.norm(u)
        if nu < 1e-10:
            return None  # Pareto-stationary: the violated/protected constraints pull in opposite directions
        d = -u / nu
        rates = H @ d                          # < 0 for every member of the set
        viol = [i for i in idx if c[i] > 0]
        need = max((c[i] / -rates[i] for i in viol if rates[i] < 0), default=delta)
        t = min(delta, need)
        z = t * d
        broken = [j for j in range(H.shape[0]) if j not in active and c[j] <= 0 and c[j] + H[j] @ z > tol]
        if not broken:
            return z
        active.update(broken)
    return z


def locu_step(reward_grad: torch.Tensor, constraint_grads: torch.Tensor | None,
              constraint_values: torch.Tensor | None, fisher: torch.Tensor | None, trust_radius: float, *,
              damping: float = 1e-8, screen: bool = True, collinear_tol: float = 1e-4, rank_tol: float = 1e-10,
              max_enumerate: int = 10, tol: float = 1e-9, return_info: bool = False):
    """One LOCU policy step.

    ``reward_grad`` [d]: gradient of the reward to increase. ``constraint_grads`` [m, d] and
    ``constraint_values`` [m]: constraint i is satisfied where its value is <= 0 and changes by about
    ``constraint_grads[i] @ step``. ``fisher`` [d, d] or None (identity). Returns the step [d] (dtype and device
    of ``reward_grad``) with ``step^T F step <= trust_radius^2``; with ``return_info=True`` also a ``LocuInfo``.
    """
    if trust_radius < 0:
        raise ValueError(f"trust_radius must be >= 0, got {trust_radius}")
    g = torch.as_tensor(reward_grad)
    out_dtype = g.dtype if g.is_floating_point() else torch.float32
    g64 = g.detach().to(torch.float64).reshape(-1)
    d = g64.numel()
    if constraint_grads is None or (torch.is_tensor(constraint_grads) and constraint_grads.numel() == 0):
        B = torch.zeros(0, d, dtype=torch.float64, device=g64.device)
        c = np.zeros(0)
    else:
        B = torch.as_tensor(constraint_grads).detach().to(torch.float64, copy=False).to(g64.device).reshape(-1, d)
        c = torch.as_tensor(constraint_values).detach().to(torch.float64).reshape(-1).cpu().numpy()
        if c.shape[0] != B.shape[0]:
            raise ValueError(f"constraint_values has {c.shape[0]} entries for {B.shape[0]} constraint gradients")
    m = B.shape[0]
    U = torch.cat([g64[None], B], 0)                                  # [m+1, d]
    NU = _natural(U, None if fisher is None else torch.as_tensor(fisher).to(g64.device), damping)
    K = (U @ NU.T).cpu().numpy()
    K = 0.5 * (K + K.T)
    info = LocuInfo()
    delta = float(trust_radius)

    # ---- screening
    bnorm = np.sqrt(np.maximum(np.diag(K)[1:], 0.0))
    scale = np.sqrt(max(np.diag(K).max(initial=0.0), 1e-300))
    kept = []
    for i in range(m):
        if bnorm[i] <= 1e-12 * scale:
            info.immovable.append(i)
        elif screen and c[i] + delta * bnorm[i] < 0:
            info.screened.append(i)
        else:
            kept.append(i)
    # ---- near-collinear compression (most restrictive member represents its group)
    order = sorted(kept, key=lambda i: -c[i] / bnorm[i])
    reps: list[int] = []
    for i in order:
        for r_ in reps:
            cos = K[1 + i, 1 + r_] / (bnorm[i] * bnorm[r_])
            if cos > 1.0 - collinear_tol:
                info.merged.setdefault(r_, []).append(i)
                break
        else:
            reps.append(i)
    info.kept = sorted(reps)
    idx = [0] + [1 + i for i in info.kept]
    Ks = K[np.ix_(idx, idx)]
    # ---- Löwdin orthogonalization of the kept natural gradients
    lam, E = np.linalg.eigh(Ks)
    keep = lam > rank_tol * max(lam.max(initial=0.0), 1e-300)
    info.reduced_dim = int(keep.sum())
    coef_of_z = None
    step64 = torch.zeros(d, dtype=torch.float64, device=g64.device)
    if info.reduced_dim and delta > 0:
        Er, lr = E[:, keep], lam[keep]
        W = Er @ np.diag(lr ** -0.5) @ Er.T                           # K^{-1/2} (Löwdin), on the kept span
        Hall = W @ Ks                                                 # column j: coordinates of Q^T u_j
        a = Hall[:, 0]
        H = Hall[:, 1:].T
        cc = c[info.kept]
        z = _solve_ball_polytope(a, H, -cc, delta, max_enumerate=max_enumerate, tol=tol)
        if z is None:
            info.mode = "recover"
            z = _pareto_descent(H, cc, delta, tol)
            if z is None:
                info.mode = "stationary"
                z = np.zeros_like(a)
        coef_of_z = W @ z                                             # step = NU[idx]^T coef
        coef = torch.as_tensor(coef_of_z, dtype=torch.float64, device=g64.device)
        step64 = coef @ NU[idx]
        fnorm = float(coef_of_z @ Ks @ coef_of_z)
        if fnorm > delta ** 2:
            step64 = step64 * (delta / np.sqrt(fnorm))
    if fisher is None:
        fn = float(step64 @ step64)
    else:
        fn = float(step64 @ (torch.as_tensor(fisher).to(step64) @ step64))
    info.fisher_norm_sq = fn
    info.reward_gain = float(g64 @ step64)
    info.predicted_values = (torch.as_tensor(c, dtype=torch.float64) + (B @ step64).cpu()).tolist() if m else []
    step = step64.to(out_dtype).reshape(g.shape)
    return (step, info) if return_info else step


def naive_projection_step(reward_grad: torch.Tensor, constraint_grads: torch.Tensor,
                          constraint_values: torch.Tensor, fisher: torch.Tensor | None, trust_radius: float,
                          damping: float = 0.0) -> torch.Tensor:
    """Baseline: scale the natural gradient to the trust region, then project it onto the linearised
    constraints with ``(B F^{-1} B^T)^{-1}`` (all constraints treated as equalities of their correction). With
    nearly collinear constraint gradients the inverse Gram matrix is huge and so is the step."""
    g = reward_grad.to(torch.float64)
    B = constraint_grads.to(torch.float64)
    c = constraint_values.to(torch.float64)
    U = torch.cat([g[None], B], 0)
    NU = _natural(U, None if fisher is None else fisher.to(torch.float64), max(damping, 0.0))
    ng, NB = NU[0], NU[1:]
    gn = torch.sqrt(torch.clamp(g @ ng, min=1e-300))
    s = trust_radius * ng / gn
    G = B @ NB.T
    viol = c + B @ s
    rhs = torch.clamp(viol, min=0.0)
    if B.shape[0] == 0:
        return s.to(reward_grad.dtype)
    lam, bad = torch.linalg.solve_ex(G, rhs)
    if int(bad):  # exactly singular in floating point: the untruncated pseudo-inverse (what the projection asks for)
        lam = torch.linalg.pinv(G, rtol=0.0) @ rhs
    return (s - NB.T @ lam).to(reward_grad.dtype)


def flat_grads(grads, params) -> torch.Tensor:
    """``grads`` (as ``torch.autograd.grad`` returns them, None for unused ``params``) as one vector, zeros for
    the unused ones, in float32 (float64 if a parameter is float64)."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).to(dtype)
                      for g, p in zip(grads, params)])


def locu_step_in_span(reward_grad: torch.Tensor, constraint_grads: torch.Tensor, constraint_values: torch.Tensor,
                      trust_radius: float, chunk: int = 1 << 22):
    """``locu_step(reward_grad, constraint_grads, constraint_values, None, trust_radius, return_info=True)``
    computed in an orthonormal basis of span{g, b_1..b_m}.

    With the identity as Fisher, LOCU's problem sees the d-vectors only through their Gram matrix K (all its
    steps, from screening to the Pareto-descent direction, work on K, and the step lies in the span), so
    calling ``locu_step`` on the (m+1)-dimensional coordinates ``W^T K`` (``W = E lam^-1/2`` from K's
    eigendecomposition, so that ``Q = U^T W`` is orthonormal) and mapping the step back with Q gives the same
    step, without float64 copies of the d-vectors (for a 135M-parameter policy those cost more than the step).
    Returns (step [d] in ``reward_grad``'s dtype, LocuInfo)."""
    U = torch.cat([reward_grad.reshape(1, -1), constraint_grads.reshape(constraint_grads.shape[0], -1)], 0)
    K = torch.zeros(U.shape[0], U.shape[0], dtype=torch.float64)
    for part in U.split(chunk, dim=1):                                # float64 accumulation across chunks
        K += (part @ part.T).to(torch.float64).cpu()
    K = 0.5 * (K + K.T)
    lam, E = torch.linalg.eigh(K)
    keep = lam > 1e-12 * max(float(lam.max()), 1e-300)
    if not bool(keep.any()):                                          # every gradient is zero: nothing moves
        keep = torch.zeros_like(keep)
        keep[-1] = True
        W = torch.zeros(U.shape[0], 1, dtype=torch.float64)
    else:
        W = E[:, keep] / lam[keep].sqrt()
    coords = W.T @ K                                                  # column j: Q^T u_j
    z, info = locu_step(coords[:, 0], coords[:, 1:].T, torch.as_tensor(constraint_values, dtype=torch.float64),
                        None, float(trust_radius), return_info=True)
    coef = (W @ z).to(U.dtype).to(U.device)
    step = coef @ U
    norm = float(step.double().norm())
    if norm > trust_radius:                                           # float32 rounding in the map back
        step = step * (trust_radius / norm)
    return step.to(reward_grad.dtype), info


def locu_constrained_step(params: list[torch.Tensor], reward_loss: torch.Tensor, constraint_surrogate: torch.Tensor,
                          constraint_value: float, trust_radius: float, grad_scale: float = 1.0):
    """One LOCU step for one constraint, written into ``.grad``.

    ``reward_loss``: a loss whose descent increases the reward (its negated gradient is LOCU's reward gradient
    g). ``constraint_surrogate``: a scalar whose gradient b is the constraint's gradient (the constraint grows
    along +b). ``constraint_value``: c, satisfied where <= 0. Solves ``max g^T s`` s.t. ``c + b^T s <= 0`` and
    ``||s|| <= trust_radius`` (identity Fisher; ``locu_step_in_span``), then adds ``-grad_scale * s`` to each
    parameter's ``.grad`` (so a descent optimizer moves along +s). Returns (s, LocuInfo)."""
    g = -flat_grads(torch.autograd.grad(reward_loss, params, retain_graph=True, allow_unused=True), params)
    b = flat_grads(torch.autograd.grad(constraint_surrogate, params, allow_unused=True), params)
    step, info = locu_step_in_span(g, b[None], torch.tensor([float(constraint_value)]), trust_radius)
    del g, b
    offset = 0
    for p in params:
        n = p.numel()
        chunk = (-grad_scale * step[offset:offset + n]).view_as(p).to(p.dtype)
        p.grad = chunk if p.grad is None else p.grad + chunk
        offset += n
    return step, info


def softmax_cmdp_toy(seed: int, num_actions: int = 8):
    """The toy CMDP used by the tests and the bench: one state (a bandit), ``num_actions`` actions, a reward
    and two cost constraints (cost 0 tracks the reward, so the constraint binds). Returns
    (reward [A], costs [2, A], limits [2]); the policy is feasible where ``costs @ pi <= limits``."""
    rng = np.random.default_rng(seed)
    reward = rng.uniform(0, 1, num_actions)
    costs = np.stack([reward + 0.1 * rng.normal(size=num_actions), rng.uniform(0, 1, num_actions)])
    limits = np.array([np.quantile(costs[0], 0.35), np.quantile(costs[1], 0.6)])
    return reward, costs, limits


def run_softmax_cmdp(seed: int, method: str = "locu", steps: int = 150, trust_radius: float = 0.05,
                     penalty: float = 1.0):
    """Optimise a softmax policy on ``softmax_cmdp_toy(seed)`` from an infeasible start (mass on the costliest
    action) with exact gradients and Fisher. ``method``: ``locu`` or ``penalty`` (natural-gradient ascent on
    ``reward - penalty * sum_i max(c_i, 0)``, same trust region). Returns (final policy, constraint values per
    step [steps, 2], reward per step [steps])."""
    reward, costs, limits = softmax_cmdp_toy(seed)
    A = len(reward)
    theta = torch.zeros(A, dtype=torch.float64)
    theta[int(np.argmax(costs[0]))] = 3.0
    C, R, L = torch.tensor(costs), torch.tensor(reward), torch.tensor(limits)
    values, rewards = [], []
    for _ in range(steps):
        pi = torch.softmax(theta, 0)

        def grad(v, pi=pi):  # d(pi . v) / d theta
            return pi * (v - pi @ v)

        c = C @ pi - L
        values.append(c.numpy().copy())
        rewards.append(float(pi @ R))
        F = torch.diag(pi) - torch.outer(pi, pi)
        if method == "locu":
            step = locu_step(grad(R), torch.stack([grad(C[0]), grad(C[1])]), c, F, trust_radius, damping=1e-6)
        elif method == "penalty":
            g = grad(R) - penalty * sum(grad(C[i]) for i in range(2) if c[i] > 0)
            step = locu_step(g, None, None, F, trust_radius, damping=1e-6)
        else:
            raise ValueError(f"method must be 'locu' or 'penalty', got {method!r}")
        theta = theta + step
    return torch.softmax(theta, 0).numpy(), np.array(values), np.array(rewards)
