"""llmkit.optim.zo: RSC-ZO (unbiasedness, exact restore, clipping, heavy-tailed convergence, momentum) and
the seed-trick engine's LQZO pieces (regeneration, restore, low rank, Rademacher moments, isotropic regrouping)."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.optim.zo import RSCZO, SeedZO, direction, isotropic_shape, mix_seed, rsc_zo_gradient


def _quadratic(dim=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(dim, dim, generator=g)
    a = q @ q.T / dim + torch.eye(dim)
    b = torch.randn(dim, generator=g)
    return a, b


# ----------------------------------------------------------------------------- rsc_zo_gradient


def test_rsc_zo_unclipped_is_unbiased_on_a_quadratic_and_restores_params_exactly():
    a, b = _quadratic()
    x = torch.randn(6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(3, 2, generator=torch.Generator().manual_seed(2))
    x0, y0 = x.clone(), y.clone()

    def loss():
        v = torch.cat([x, y.flatten()])[:6]
        return 0.5 * v @ a @ v + b @ v + (y ** 2).sum()

    gen = torch.Generator().manual_seed(3)
    gx, gy = rsc_zo_gradient(loss, [x, y], num_directions=6000, mu=1e-2, clip=None, generator=gen)
    v = torch.cat([x, y.flatten()])[:6]
    true_x = (a @ v + b)
    true_y = 2 * y
    assert torch.equal(x, x0) and torch.equal(y, y0), "params not restored bit-exactly"
    assert gx.shape == x.shape and gy.shape == y.shape
    # standard error of the mean over 6000 directions ~ ||g|| * sqrt(d / n) ~ 0.15 per coordinate here
    assert torch.allclose(gx, true_x, atol=0.5), (gx, true_x)
    assert torch.allclose(gy, true_y, atol=0.5), (gy, true_y)
    # and the mean is right on average, not by luck in one coordinate: relative error small
    assert (torch.cat([gx, gy.flatten()]) - torch.cat([true_x, true_y.flatten()])).norm() < 0.1 * math.sqrt(
        true_x.norm() ** 2 + true_y.norm() ** 2) + 0.2


def test_rsc_zo_clips_each_scalar_directional_derivative():
    x = torch.zeros(4)

    def loss():  # slope 1000 along the first coordinate
        return 1000.0 * x[0]

    u = torch.randn(4, generator=torch.Generator().manual_seed(9))
    (g,) = rsc_zo_gradient(loss, [x], 1, 1e-3, clip=2.0, generator=torch.Generator().manual_seed(9))
    d = max(-2.0, min(2.0, 1000.0 * u[0].item()))
    assert torch.allclose(g, d * u, atol=1e-3)
    (g_raw,) = rsc_zo_gradient(loss, [x], 1, 1e-3, clip=None, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(g_raw, 1000.0 * u[0] * u, rtol=1e-3)


def _heavy_tailed_run(clip, steps=400, seed=0, momentum=0.0, dim=10):
    """ZO-SGD on f(x; xi) = 0.5 ||x||^2 + xi^T x with Student-t(df=1.2) xi: infinite-variance gradient noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(1.2))
    torch.manual_seed(seed)
    x = torch.full((dim,), 3.0)
    xi = torch.zeros(dim)
    opt = RSCZO([x], lr=0.05, mu=1e-3, num_directions=4, clip=clip, momentum=momentum, generator=gen)
    dists = []
    for _ in range(steps):
        xi.copy_(t.sample((dim,)))  # one sample per step, shared by its 2q evaluations
        opt.step(lambda: 0.5 * (x ** 2).sum() + xi @ x)
        dists.append(x.norm().item())
    return dists


def test_rsc_zo_converges_under_infinite_variance_noise_where_unclipped_does_not():
    clipped, unclipped = [], []
    for seed in range(2):
        c = _heavy_tailed_run(clip=5.0, seed=seed, steps=300)
        u = _heavy_tailed_run(clip=None, seed=seed, steps=300)
        clipped.append(sum(c[-100:]) / 100)
        unclipped.append(sum(u[-100:]) / 100 if all(math.isfinite(v) for v in u) else float("inf"))
    start = 3.0 * math.sqrt(10)
    # clipped: settles near the optimum (noise floor ~ lr * clip), far below the start
    assert max(clipped) < 0.35 * start, clipped
    # unclipped: heavy-tailed kicks keep throwing it far away in at least one run, and on average
    assert max(unclipped) > 3 * max(clipped), (clipped, unclipped)
    assert min(unclipped) > 2 * max(clipped), (clipped, unclipped)


def test_rsc_zo_momentum_variant_converges_and_keeps_a_buffer():
    d = _heavy_tailed_run(clip=5.0, momentum=0.9, seed=0, steps=300)
    assert sum(d[-100:]) / 100 < 0.35 * 3.0 * math.sqrt(10)
    x = torch.ones(3)
    opt = RSCZO([x], lr=0.1, momentum=0.5)
    opt.step(lambda: (x ** 2).sum())
    assert "momentum_buffer" in opt.state[x]
    with pytest.raises(ValueError, match="momentum"):
        RSCZO([x], lr=0.1, momentum=1.0)


# ----------------------------------------------------------------------------- directions


def test_same_seed_regenerates_the_same_perturbation_and_different_seeds_differ():
    for kw in ({}, {"distribution": "rademacher"}, {"rank": 2, "distribution": "rademacher", "isotropic": True}):
        a = direction((48, 6), 123, **kw)
        b = direction((48, 6), 123, **kw)
        c = direction((48, 6), 124, **kw)
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    assert mix_seed(1, 2, 3) != mix_seed(1, 3, 2) and mix_seed(5) == mix_seed(5)


@pytest.mark.parametrize("shape,rank,iso", [((96, 6), 2, False), ((96, 6), 3, True), ((40, 40), 1, False)])
def test_low_rank_perturbation_has_the_stated_rank(shape, rank, iso):
    z = direction(shape, 7, distribution="rademacher", rank=rank, isotropic=iso)
    view = z.reshape(isotropic_shape(shape) if iso else shape)
    assert torch.linalg.matrix_rank(view).item() == rank
    full = direction(shape, 7, distribution="rademacher", rank=0)
    assert torch.linalg.matrix_rank(full.reshape(isotropic_shape(shape) if iso else shape)).item() > rank


def test_rademacher_and_gaussian_factor_moments():
    r = 4
    n = 400
    rad = torch.stack([direction((64, 64), s, distribution="rademacher", rank=r) for s in range(n)])
    gau = torch.stack([direction((64, 64), s, distribution="gaussian", rank=r) for s in range(n)])
    for z in (rad, gau):
        assert abs(z.mean().item()) < 0.01
        assert abs(z.pow(2).mean().item() - 1.0) < 0.02  # unit variance: E[z z^T] = I, the estimate stays unbiased
    # binary-aggregated: each entry is a sum of r +-1 / sqrt(r): bounded, E z^4 = 3 - 2/r; Gaussian factors: 3 + 6/r
    assert rad.abs().max().item() <= math.sqrt(r) + 1e-6
    assert abs(rad.pow(4).mean().item() - (3 - 2 / r)) < 0.05
    assert abs(gau.pow(4).mean().item() - (3 + 6 / r)) < 0.4
    assert gau.abs().max().item() > math.sqrt(r)
    iid = direction((1000, 10), 0, distribution="rademacher")
    assert set(iid.unique().tolist()) == {-1.0, 1.0}


def test_isotropic_shape_keeps_rows_and_is_closest_to_square():
    assert isotropic_shape((576, 9)) == (72, 72)
    assert isotropic_shape((256, 4)) == (32, 32)
    for shape in [(576, 24), (1536, 9), (192, 9), (7, 3)]:
        a, b = isotropic_shape(shape)
        assert a * b == shape[0] * shape[1] and shape[0] % a == 0
        assert max(a, b) / min(a, b) <= max(shape) / min(shape)
    # whole rows: the regrouped view is a plain reshape (row k of the view = rows k*j .. k*j+j-1)
    s = torch.arange(576 * 9.0).reshape(576, 9)
    v = s.reshape(isotropic_shape(s.shape))
    assert torch.equal(v[0], s[:8].flatten())


def _kurtosis(shape, iso, g, n=5000):
    p = torch.stack([(direction(shape, s, distribution="gaussian", rank=1, isotropic=iso) * g).sum() for s in range(n)])
    return (p.pow(2).mean() / g.pow(2).sum()).item(), (p.pow(4).mean() / p.pow(2).mean() ** 2).item()


def test_isotropic_regrouping_makes_the_projected_derivative_closer_to_isotropic():
    """For a generic gradient G the low-rank projection <U V^T, G> has kurtosis 3 (1 + 2 tr(M^2) / tr(M)^2),
    M = G'^T G' on the factorized view G'; regrouping (256, 4) -> (32, 32) lowers it toward 3 (isotropic
    Gaussian), while the second moment stays ||G||^2 (unbiased)."""
    shape = (256, 4)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))

    def theory(view):
        m = view.T @ view
        return 3 * (1 + 2 * (m @ m).trace().item() / m.trace().item() ** 2)

    m2_plain, k_plain = _kurtosis(shape, False, g)
    m2_iso, k_iso = _kurtosis(shape, True, g)
    assert abs(m2_plain - 1) < 0.1 and abs(m2_iso - 1) < 0.1
    t_plain, t_iso = theory(g), theory(g.reshape(isotropic_shape(shape)))
    assert t_plain > 4.3 and t_iso < 3.5
    assert abs(k_plain - t_plain) < 0.15 * t_plain and abs(k_iso - t_iso) < 0.15 * t_iso
    assert k_iso < k_plain - 0.6


# ----------------------------------------------------------------------------- SeedZO


def test_seedzo_perturb_then_restore_is_bit_exact_and_regeneration_is_deterministic():
    torch.manual_seed(0)
    s = torch.rand(64, 6) * 1e-2 + 1e-3
    w = torch.randn(32)
    s0, w0 = s.clone(), w.clone()
    zo = SeedZO([s, w], modes=["mul", "add"], mu=1e-2, rank=2, distribution="rademacher", isotropic=True, seed=5)
    for step in range(3):
        for sign in (1.0, -1.0):
            zo.perturb(step, 0, sign)
            assert not torch.equal(s, s0)
            first = s.clone()
            zo.restore()
            assert torch.equal(s, s0) and torch.equal(w, w0), "restore is not bit-exact"
            zo.perturb(step, 0, sign)
            assert torch.equal(s, first), "the same seed did not regenerate the same perturbation"
            zo.restore()
    # MeZO's regenerate-and-subtract (no copy): equal up to rounding
    x = torch.randn(1000)
    x0 = x.clone()
    mezo = SeedZO([x], mu=1e-3, exact_restore=False)
    mezo.projected(lambda: (x ** 2).sum(), 0, 0)
    assert torch.allclose(x, x0, atol=1e-6) and mezo.backup_bytes() == 0
    with pytest.raises(ValueError, match="exact_restore"):
        SeedZO([x], modes=["mul"], exact_restore=False)


@pytest.mark.parametrize("mode,rank,dist,iso", [("add", 0, "gaussian", False), ("mul", 2, "rademacher", True),
                                                ("mul", 0, "gaussian", False)])
def test_seedzo_projected_gradient_is_unbiased_on_a_quadratic(mode, rank, dist, iso):
    """Per seed, d_k is the exact directional derivative (quadratic); averaged over seeds, d_k z_k -> gradient
    (in the relative coordinates for 'mul': x * grad)."""
    a_mat, b_vec = _quadratic(dim=24, seed=3)
    x = (torch.rand(4, 6, generator=torch.Generator().manual_seed(4)) + 0.5)

    def loss():
        v = x.flatten()
        return 0.5 * v @ a_mat @ v + b_vec @ v

    grad = (a_mat @ x.flatten() + b_vec).reshape(4, 6)
    target = grad * x if mode == "mul" else grad
    zo = SeedZO([x], modes=[mode], mu=1e-3, rank=rank, distribution=dist, isotropic=iso, seed=11)
    n = 2500
    est = torch.zeros_like(x)
    for step in range(n):
        d, _, _ = zo.projected(loss, step, 0)
        z = zo.z(step, 0, 0)
        if step < 5:  # each projection is the true directional derivative (quadratic: central difference exact)
            expect = (target * z).sum().item()
            assert abs(d - expect) < 2e-2 * (1 + abs(expect))
        est += d * z / n
    err = (est - target).norm() / target.norm()
    assert err < 0.15, err


def test_seedzo_update_matches_the_formula():
    s = torch.rand(8, 4) + 0.5
    w = torch.randn(5)
    s0, w0 = s.clone(), w.clone()
    zo = SeedZO([s, w], modes=["mul", "add"], mu=1e-3, num_directions=2, rank=1, distribution="rademacher", seed=2)
    d = [0.7, -1.3]
    zo.update(10, d, lr=0.1, weight_decay=[0.0, 0.5])
    zs = [zo.z(10, k, 0) for k in range(2)]
    zw = [zo.z(10, k, 1) for k in range(2)]
    assert torch.allclose(s, s0 * torch.exp(-0.1 * (0.7 * zs[0] - 1.3 * zs[1]) / 2), atol=1e-6)
    assert torch.allclose(w, w0 * (1 - 0.05) - 0.1 * (0.7 * zw[0] - 1.3 * zw[1]) / 2, atol=1e-6)
    assert SeedZO([s], clip=1.0).clipped([5.0, -0.5, -9.0]) == [1.0, -0.5, -1.0]


def test_lazy_v_conditional_expectation_is_the_gradient_projected_on_v_and_unbiased_over_v():
    """At the shipped v_interval (10) V is shared by the steps of a window and by the q directions, so given V the
    estimate is biased: E[d z | V] = G V V^T / r on the factorized 2-D view (E[U U^T] = I). Over V it is G."""
    from llmkit.optim.zo import _generator, isotropic_shape, mix_seed, sample

    torch.manual_seed(0)
    shape, rank, q = (12, 8), 2, 100
    grad = torch.randn(shape)
    x = torch.zeros(shape)
    zo = SeedZO([x], modes=["add"], mu=1e-3, num_directions=q, rank=rank, distribution="rademacher",
                isotropic=True, v_interval=10, seed=7)

    def loss():  # linear: the central difference is the exact directional derivative
        return (grad * x).sum()

    m, n = isotropic_shape(shape)
    g2 = grad.reshape(m, n)

    def window_mean(window):
        est = torch.zeros(shape)
        for step in range(window * 10, window * 10 + 10):
            for k in range(q):
                d, _, _ = zo.projected(loss, step, k)
                est += d * zo.z(step, k, 0) / (10 * q)
        return est

    est0 = window_mean(0)
    v = sample((n, rank), _generator(mix_seed(7, 0x5EED, 0, 0), None), "rademacher")
    cond = (g2 @ v @ v.T / rank).reshape(shape)
    assert (est0 - cond).norm() / cond.norm() < 0.2
    assert (est0 - grad).norm() / grad.norm() > 0.5, "given V the estimate should not be the full gradient"
    over_v = sum(window_mean(w) for w in range(8)) / 8  # 8 windows = 8 draws of V
    assert (over_v - grad).norm() / grad.norm() < (est0 - grad).norm() / grad.norm()
