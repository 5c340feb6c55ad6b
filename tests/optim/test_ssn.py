"""Semismooth Newton with lazy Hessians: superlinear local convergence on a problem whose gradient is only
semismooth (|w|^3 and squared-hinge terms), with the generalized Hessian evaluated every k steps."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmkit.optim import SemismoothNewton

D = torch.float64


def _problem(d=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, d, generator=g, dtype=D)
    a = m @ m.T / d + 0.1 * torch.eye(d, dtype=D)
    b = torch.randn(d, generator=g, dtype=D) * 2

    def f(w):  # gradient Lipschitz, Hessian discontinuous at w_j = 0 and at w_j = 0.3
        return 0.5 * w @ a @ w - b @ w + (w.abs() ** 3).sum() / 3 + 2 * torch.relu(w - 0.3).pow(2).sum()

    return f


def _solve(k, steps=25, hessian_fn=None):
    f = _problem()
    w = torch.nn.Parameter(torch.zeros(20, dtype=D))
    opt = SemismoothNewton([w], hessian_every=k, hessian_fn=hessian_fn)
    norms = []
    for _ in range(steps):
        opt.step(lambda: f(w))
        norms.append(opt.last_grad_norm)
        if norms[-1] < 1e-12:
            break
    return norms, opt, w


@pytest.mark.parametrize("k", [1, 3, 5])
def test_superlinear_local_convergence_with_lazy_hessians(k):
    norms, opt, _ = _solve(k)
    assert norms[-1] < 1e-11, norms
    # superlinear: the contraction factor of the gradient norm goes to 0 over the last steps
    tail = [b / a for a, b in itertools.pairwise(norms) if a < 1e-2]
    assert len(tail) >= 2 and min(tail[-2:]) < 1e-2, tail
    assert opt.hessian_evals == -(-opt.iterations // k)  # ceil: one evaluation every k steps


def test_gradient_descent_is_only_linear_on_the_same_problem():
    f = _problem()
    w = torch.zeros(20, dtype=D, requires_grad=True)
    for _ in range(25):
        g = torch.autograd.grad(f(w), w)[0]
        with torch.no_grad():
            w -= 0.1 * g
    assert g.norm() > 1e-3  # SSN reaches 1e-11 in about as many steps


def test_hessian_oracle_gives_the_same_iterates_as_autograd():
    f = _problem()

    def oracle(x):
        return torch.autograd.functional.hessian(f, x)

    _a, _, wa = _solve(3, steps=8)
    _b, opt, wb = _solve(3, steps=8, hessian_fn=oracle)
    assert torch.allclose(wa.detach(), wb.detach(), atol=1e-10)
    assert opt.hessian_evals == 3


def test_step_needs_a_closure_and_valid_settings():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="closure"):
        SemismoothNewton([w]).step()
    with pytest.raises(ValueError, match="hessian_every"):
        SemismoothNewton([w], hessian_every=0)
