"""LOCU: trust region, optimality of the reduced solve, infeasible starts, near-collinear constraints, and the
paper's setting (a softmax policy in a constrained MDP with several cost constraints, exact Fisher)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import linprog, minimize

from llmkit.optim.constrained import locu_step, naive_projection_step, run_softmax_cmdp, softmax_cmdp_toy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _random_problem(seed, d=12, m=4, fisher=True):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(d, generator=g, dtype=torch.float64)
    B = torch.randn(m, d, generator=g, dtype=torch.float64)
    c = torch.randn(m, generator=g, dtype=torch.float64) * 0.3
    F = None
    if fisher:
        A = torch.randn(d, d, generator=g, dtype=torch.float64)
        F = A @ A.T / d + 0.05 * torch.eye(d, dtype=torch.float64)
    return r, B, c, F


def _reference(r, B, c, F, delta):
    """The same linearised problem solved by SLSQP in the full space (max r^T s)."""
    Fm = np.eye(len(r)) if F is None else F.numpy()
    rn, Bn, cn = r.numpy(), B.numpy(), c.numpy()
    cons = [{"type": "ineq", "fun": lambda s: -(cn + Bn @ s)},
            {"type": "ineq", "fun": lambda s: np.array([delta ** 2 - s @ Fm @ s])}]
    res = minimize(lambda s: -rn @ s, np.zeros(len(rn)), constraints=cons, method="SLSQP",
                   options={"maxiter": 1000, "ftol": 1e-13})
    ok = np.all(cn + Bn @ res.x <= 1e-7) and res.x @ Fm @ res.x <= delta ** 2 * (1 + 1e-6)
    return float(rn @ res.x) if ok else None


@pytest.mark.parametrize("seed", range(12))
def test_locu_within_trust_region_and_optimal_when_feasible(seed):
    r, B, c, F = _random_problem(seed, fisher=seed % 2 == 0)
    delta = 0.5
    s, info = locu_step(r, B, c, F, delta, return_info=True)
    Fm = torch.eye(len(r), dtype=torch.float64) if F is None else F
    assert float(s @ Fm @ s) <= delta ** 2 * (1 + 1e-9)
    ref = _reference(r, B, c, F, delta)
    if ref is not None:  # the linearised problem is feasible: LOCU solves it (to the reference's accuracy)
        assert info.mode == "optimize"
        assert np.all(np.asarray(info.predicted_values) <= 1e-7)
        assert float(r @ s) >= ref - 1e-5 * (1 + abs(ref))
        assert float(r @ s) <= ref + 1e-3 * (1 + abs(ref))


def test_locu_without_constraints_is_the_scaled_natural_gradient():
    r, _, _, F = _random_problem(3)
    s = locu_step(r, torch.zeros(0, len(r), dtype=torch.float64), torch.zeros(0), F, 0.2)
    ng = torch.linalg.solve(F, r)
    expected = 0.2 * ng / torch.sqrt(r @ ng)
    assert torch.allclose(s, expected, atol=1e-6)
    # fisher None is the identity
    s_id = locu_step(r.float(), None, None, None, 0.2)
    assert s_id.dtype == torch.float32
    assert torch.allclose(s_id.double(), 0.2 * r / r.norm(), atol=1e-6)


def test_locu_screening_drops_constraints_that_cannot_bind():
    r, B, _, F = _random_problem(5, m=3)
    c = torch.tensor([-100.0, -100.0, 0.1], dtype=torch.float64)
    _, info = locu_step(r, B, c, F, 0.3, return_info=True)
    assert info.screened == [0, 1] and info.kept == [2]
    assert info.predicted_values[2] <= 1e-9


def test_locu_infeasible_start_reduces_every_violated_and_keeps_satisfied():
    # far from feasibility: the linearised constraints cannot all be met in one trust-region step
    rng = np.random.default_rng(0)
    for trial in range(10):
        d, m = 15, 5
        r = torch.tensor(rng.normal(size=d))
        B = torch.tensor(rng.normal(size=(m, d)))
        c = torch.tensor([3.0, 2.0, 5.0, -0.05, -0.02])     # three violated, two barely satisfied
        s, info = locu_step(r, B, c, None, 0.1, return_info=True)
        assert info.mode == "recover"
        assert float(s @ s) <= 0.01 * (1 + 1e-9)
        new = c + B @ s
        assert torch.all(new[:3] < c[:3] - 1e-6), f"trial {trial}: a violated constraint did not decrease"
        assert torch.all(new[3:] <= 1e-9), f"trial {trial}: a satisfied constraint was broken"


def test_locu_is_stable_with_nearly_collinear_constraints_where_naive_projection_blows_up():
    g = torch.Generator().manual_seed(1)
    d = 30
    r = torch.randn(d, generator=g, dtype=torch.float64)
    b = r + torch.randn(d, generator=g, dtype=torch.float64)   # costs rise with the reward
    B = torch.stack([b + 1e-8 * torch.randn(d, generator=g, dtype=torch.float64) for _ in range(4)]
                    + [torch.randn(d, generator=g, dtype=torch.float64)])
    c = torch.tensor([0.3, 0.31, 0.29, 0.3, -0.2], dtype=torch.float64)
    delta = 0.5
    s, info = locu_step(r, B, c, None, delta, return_info=True)
    assert torch.isfinite(s).all() and float(s.norm()) <= delta * (1 + 1e-9)
    assert len(info.merged) == 1 and len(next(iter(info.merged.values()))) == 3
    new = c + B @ s
    assert torch.all(new <= 1e-6)
    naive = naive_projection_step(r, B, c, None, delta)
    assert float(naive.norm()) > 100 * delta  # the (B B^T)^{-1} projection explodes


def test_locu_cmdp_reaches_feasibility_from_an_infeasible_start_and_near_lp_optimum():
    reward, costs, limits = softmax_cmdp_toy(0)
    pi, values, _ = run_softmax_cmdp(0, "locu", steps=150, trust_radius=0.05)
    assert values[0].max() > 0.1
    first_feasible = int(np.argmax(values.max(1) <= 1e-3))
    assert values[first_feasible].max() <= 1e-3 and first_feasible < 60
    assert values[-20:].max() <= 5e-3                   # stays (nearly) feasible after that
    A = len(reward)
    lp = linprog(-reward, A_ub=costs, b_ub=limits, A_eq=np.ones((1, A)), b_eq=[1.0], bounds=[(0, 1)] * A)
    assert lp.status == 0
    assert pi @ reward >= -lp.fun - 0.03
    # a fixed reward penalty of the same size ends infeasible on this toy (the costly action pays)
    _, pen_values, _ = run_softmax_cmdp(0, "penalty", steps=150, trust_radius=0.05, penalty=0.5)
    assert pen_values[-1].max() > 1e-2
