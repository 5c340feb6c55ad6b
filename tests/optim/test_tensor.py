"""Rank-one tensor recovery on the Segre manifold (the paper's synthetic setting: Gaussian measurement tensors,
a planted unit rank-one tensor, small Gaussian noise): RGN reaches the noise floor in fewer iterations than RGD,
with a quadratic first phase; RGD converges linearly; both keep rank one."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.optim.tensor import compose, rank_one_approx, recover_rank_one

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _problem(shape, m, sigma, seed):
    g = torch.Generator().manual_seed(seed)
    us = [torch.randn(n, generator=g, dtype=torch.float64) for n in shape]
    X = compose(1.0, [u / u.norm() for u in us])
    A = torch.randn(m, *shape, generator=g, dtype=torch.float64)
    y = (A.reshape(m, -1) @ X.reshape(-1)) + sigma * torch.randn(m, generator=g, dtype=torch.float64)
    return A, y, X


def _errors(A, y, X, method, iters, step=1.0):
    errs = []
    est = recover_rank_one(A, y, X.shape, method, iters=iters, step_size=step,
                           callback=lambda it, Z: errs.append(float((Z - X).norm())))
    return est, errs


def _first_within(errs, level):
    return next(i for i, e in enumerate(errs) if e <= level)


@pytest.mark.parametrize("seed", [0, 1])
def test_rgn_reaches_noise_floor_in_fewer_iterations_than_rgd(seed):
    shape, m, sigma = (8, 8, 8), 150, 1e-4
    A, y, X = _problem(shape, m, sigma, seed)
    est_n, rgn = _errors(A, y, X, "rgn", 8)
    est_d, rgd = _errors(A, y, X, "rgd", 60)
    dof = sum(shape) - len(shape) + 1
    floor = sigma * math.sqrt(dof / m)
    assert rgn[-1] < 3 * floor and rgd[-1] < 3 * floor       # both reach the statistical floor ...
    level = 1.5 * min(rgn[-1], rgd[-1])
    it_n, it_d = _first_within(rgn, level), _first_within(rgd, level)
    assert it_n <= 5 and it_d >= 3 * it_n, (it_n, it_d)      # ... RGN in a handful of iterations
    # quadratic initial phase: e_{t+1} <= C e_t^2 while far above the floor; RGD contracts only linearly
    for t in range(it_n - 1):
        if rgn[t + 1] > 10 * floor:
            assert rgn[t + 1] <= 1.0 * rgn[t] ** 2, rgn
    ratios = [rgd[t + 1] / rgd[t] for t in range(2, 12)]
    assert min(ratios) > 0.3 and max(ratios) < 0.95, ratios
    # estimates are rank one with the requested shape
    for est in (est_n, est_d):
        assert est.shape == shape
        lam, fac = rank_one_approx(est)
        assert torch.allclose(compose(lam, fac), est, atol=1e-10)


def test_rgn_noiseless_is_exact_and_rgd_step_too_large_diverges():
    A, y, X = _problem((6, 5, 4), 90, 0.0, 3)
    _, errs = _errors(A, y, X, "rgn", 8)
    assert errs[-1] < 1e-10
    _, bad = _errors(A, y, X, "rgd", 15, step=3.0)
    assert bad[-1] > 0.1                                       # the iteration is not a no-op: steps matter


def test_recover_rank_one_order_four_and_bad_shapes():
    A, y, X = _problem((4, 3, 5, 3), 120, 1e-6, 4)
    est = recover_rank_one(A, y, X.shape, "rgn", iters=10)
    assert float((est - X).norm()) < 1e-4
    with pytest.raises(ValueError, match="measure must be"):
        recover_rank_one(A, y, (4, 3, 5), "rgd")
    with pytest.raises(ValueError, match="method"):
        recover_rank_one(A, y, X.shape, "sgd")
