"""Stochastic mirror descent, unmodified, under heavy-tailed noise: entropy iterates stay on the simplex and
the averaged iterate approaches the optimum of a linear objective over the simplex."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.optim import MirrorDescent

COSTS = torch.tensor([1.0, 0.0, 2.0, 1.5, 0.8], dtype=torch.float64)


def _simplex_run(seed, steps=1500, lr0=0.1, df=1.5):
    torch.manual_seed(seed)
    noise = torch.distributions.StudentT(df).sample((steps, 5)).double()
    x = torch.nn.Parameter(torch.full((5,), 0.2, dtype=torch.float64))
    opt = MirrorDescent([x], lr=lr0, mirror="entropy")
    worst = 0.0
    for t in range(steps):
        opt.param_groups[0]["lr"] = lr0 / math.sqrt(t + 1)
        x.grad = COSTS + noise[t]
        opt.step()
        worst = max(worst, abs(float(x.sum()) - 1.0))
        assert (x.detach() >= 0).all()
    return float(opt.averaged()[0] @ COSTS), worst, x


def test_entropy_mirror_descent_stays_on_the_simplex_and_converges_under_infinite_variance_noise():
    gaps = {}
    worst = 0.0
    for steps in (150, 1500):
        vals = []
        for seed in range(5):
            value, w, _ = _simplex_run(seed, steps=steps)
            vals.append(value - float(COSTS.min()))
            worst = max(worst, w)
        gaps[steps] = sum(vals) / len(vals)
    assert worst < 1e-9
    # uniform start: gap 1.06; the averaged iterate's expected gap shrinks like T^(1/p - 1) = T^(-1/3)
    assert gaps[1500] < 0.35 and gaps[1500] < 0.75 * gaps[150], gaps


def test_huge_gradients_do_not_break_the_simplex():
    x = torch.nn.Parameter(torch.tensor([0.5, 0.25, 0.25]))
    opt = MirrorDescent([x], lr=1.0, mirror="entropy")
    x.grad = torch.tensor([1e30, -1e30, 0.0])
    opt.step()
    assert torch.isfinite(x).all() and abs(float(x.sum()) - 1) < 1e-6 and x[1] > 0.99
    y = torch.nn.Parameter(torch.tensor([0.5, 0.25, 0.25]))
    opt = MirrorDescent([y], lr=1.0, mirror="entropy")
    y.grad = torch.tensor([200.0, 0.0, 0.0])
    opt.step()
    assert y[0] == 0  # exp(-200) underflows in float32 ...
    y.grad = torch.tensor([-400.0, 0.0, 0.0])
    opt.step()
    assert y[0] > 0.99 and abs(float(y.sum()) - 1) < 1e-6  # ... but the kept log-weight brings it back


def test_euclidean_is_sgd_and_p_norm_maps_are_inverse():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(a.detach().clone())
    g = torch.randn(4)
    a.grad, b.grad = g.clone(), g.clone()
    MirrorDescent([a], lr=0.1).step()
    torch.optim.SGD([b], lr=0.1).step()
    assert torch.equal(a, b)
    x = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    x0 = x.detach().clone()
    x.grad = torch.zeros(6, dtype=torch.float64)
    MirrorDescent([x], lr=0.1, mirror="p_norm", p=1.5).step()
    assert torch.allclose(x.detach(), x0)  # zero gradient: grad psi* (grad psi (x)) = x


def test_p_norm_mirror_descent_minimizes_a_sparse_least_squares():
    torch.manual_seed(1)
    d = 50
    target = torch.zeros(d, dtype=torch.float64)
    target[:3] = torch.tensor([2.0, -1.0, 1.5], dtype=torch.float64)
    x = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
    opt = MirrorDescent([x], lr=0.2, mirror="p_norm")
    for _ in range(300):
        x.grad = x.detach() - target
        opt.step()
    assert (x.detach() - target).norm() < 0.05 * target.norm()


def test_non_simplex_parameters_are_refused_for_entropy():
    with pytest.raises(ValueError, match="probability vector"):
        MirrorDescent([torch.nn.Parameter(torch.tensor([0.5, 0.7]))], lr=0.1, mirror="entropy")
    with pytest.raises(ValueError, match="mirror"):
        MirrorDescent([torch.nn.Parameter(torch.ones(2))], lr=0.1, mirror="kl")
