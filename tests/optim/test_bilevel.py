"""llmkit.optim.bilevel: pseudoinverse solves, optimistic selection and the hypergradient on a quadratic
bilevel problem whose lower level has an affine (non-isolated) solution set, against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.optim.bilevel import (
    HVP,
    flat_directions,
    hgms_step,
    hypergradient,
    lanczos,
    optimistic_select,
    pinv_solve,
)


@pytest.fixture(autouse=True)
def _float64():
    """The finite-difference checks need double precision; restored so other tests keep float32."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


def _problem(seed=0, n=7, r=3, k=3):
    """g(w, y) = sum_k w_k/2 ||C_k M y - b_k||^2 (M: r x n, so S(w) = {y: M y = z*(w)} has dim n - r);
    f(y) = 1/2 ||D (y - c)||^2 with D diagonal, not the identity (so the selection is not a projection)."""
    rng = np.random.default_rng(seed)
    M = rng.normal(size=(r, n))
    Cs = [rng.normal(size=(2, r)) for _ in range(k)]
    bs = [rng.normal(size=2) for _ in range(k)]
    D = np.diag(rng.uniform(0.5, 2.0, size=n))
    c = rng.normal(size=n)
    return M, Cs, bs, D, c


def _exact(w, M, Cs, bs, D, c):
    """The optimistic selection y*(w) and phi(w) = f(y*(w)) in closed form (KKT of min f s.t. M y = z*)."""
    A = sum(wk * C.T @ C for wk, C in zip(w, Cs))
    z = np.linalg.solve(A, sum(wk * C.T @ b for wk, C, b in zip(w, Cs, bs)))
    Di2 = np.linalg.inv(D @ D)
    lam = np.linalg.solve(M @ Di2 @ M.T, M @ c - z)
    y = c - Di2 @ M.T @ lam
    return y, 0.5 * np.sum((D @ (y - c)) ** 2)


def _closures(M, Cs, bs, D, c, y, w):
    Mt, Dt, ct = torch.tensor(M), torch.tensor(D), torch.tensor(c)
    Ct, bt = [torch.tensor(C) for C in Cs], [torch.tensor(b) for b in bs]

    def inner():
        return sum(w[i] * 0.5 * ((Ct[i] @ (Mt @ y) - bt[i]) ** 2).sum() for i in range(len(Ct)))

    def outer():
        return 0.5 * ((Dt @ (y - ct)) ** 2).sum()

    return inner, outer


def _fd(w, prob, eps=1e-6):
    g = np.zeros_like(w)
    for i in range(len(w)):
        e = np.zeros_like(w)
        e[i] = eps
        g[i] = (_exact(w + e, *prob)[1] - _exact(w - e, *prob)[1]) / (2 * eps)
    return g


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hypergradient_at_optimistic_selection_matches_finite_differences(seed):
    prob = _problem(seed)
    w0 = np.array([0.5, 1.0, 1.5])
    y_star, _ = _exact(w0, *prob)
    y = torch.tensor(y_star, requires_grad=True)
    w = torch.tensor(w0, requires_grad=True)
    inner, outer = _closures(*prob, y, w)
    hg = hypergradient(inner, outer, [y], [w], iters=10, rtol=1e-8)
    assert hg.solve.kept == 3, "H has rank r = 3: three Ritz values kept, the flat ones dropped"
    np.testing.assert_allclose(hg.grads[0].numpy(), _fd(w0, prob), rtol=1e-5, atol=1e-7)


def test_selection_then_differentiate_from_another_solution_matches_and_skipping_selection_does_not():
    prob = _problem(3)
    M = prob[0]
    w0 = np.array([1.0, 0.3, 2.0])
    y_star, phi = _exact(w0, *prob)
    # another lower-level solution: y* plus a large move inside the kernel of M (same inner loss)
    null = np.linalg.svd(M)[2][3:].T
    y_other = y_star + null @ np.random.default_rng(0).normal(size=null.shape[1]) * 3
    fd = _fd(w0, prob)

    y = torch.tensor(y_other, requires_grad=True)
    w = torch.tensor(w0, requires_grad=True)
    inner, outer = _closures(*prob, y, w)
    naive = hypergradient(inner, outer, [y], [w], iters=10, rtol=1e-8).grads[0].numpy()
    assert np.abs(naive - fd).max() > 1e-2 * np.abs(fd).max(), "without selection the formula should be off"

    hg, sel = hgms_step(inner, outer, [y], [w], select_steps=150, select_lr=0.4, iters=10, rtol=1e-8, probes=4,
                        generator=torch.Generator().manual_seed(0))
    assert sel.outer_losses[-1] < sel.outer_losses[0]
    assert sel.outer_losses[-1] == pytest.approx(phi, rel=1e-6)
    np.testing.assert_allclose(y.detach().numpy(), y_star, atol=1e-5)  # moved along S(w) to the selection
    np.testing.assert_allclose(hg.grads[0].numpy(), fd, rtol=1e-4, atol=1e-6)
    # the selection never left the solution set: the inner gradient stays zero
    assert torch.autograd.grad(inner(), y)[0].abs().max() < 1e-8


def test_pinv_solve_matches_numpy_pinv_and_drops_small_eigenvalues():
    rng = np.random.default_rng(5)
    U = np.linalg.qr(rng.normal(size=(30, 30)))[0]
    eig = np.zeros(30)
    eig[:5] = [9.0, 4.0, 2.0, 1.0, 0.5]
    eig[5:8] = 1e-9  # numerically flat: must be treated as zero
    H = U @ np.diag(eig) @ U.T
    b = rng.normal(size=30)
    res = pinv_solve(lambda v: torch.tensor(H) @ v, torch.tensor(b), iters=30, rtol=1e-6)
    H5 = U[:, :5] @ np.diag(eig[:5]) @ U[:, :5].T
    np.testing.assert_allclose(res.solution.numpy(), np.linalg.pinv(H5) @ b, atol=1e-8)
    P_null = np.eye(30) - U[:, :5] @ U[:, :5].T
    np.testing.assert_allclose(res.null_part.numpy(), P_null @ b, atol=1e-8)
    assert res.kept == 5 and res.matvecs <= 30
    # negative curvature is dropped by default, inverted when asked
    Hn = U @ np.diag(np.r_[3.0, -2.0, np.zeros(28)]) @ U.T
    pos = pinv_solve(lambda v: torch.tensor(Hn) @ v, torch.tensor(b), iters=10, rtol=1e-6)
    both = pinv_solve(lambda v: torch.tensor(Hn) @ v, torch.tensor(b), iters=10, rtol=1e-6, drop_negative=False)
    assert pos.kept == 1 and both.kept == 2
    np.testing.assert_allclose(both.solution.numpy(), np.linalg.pinv(Hn) @ b, atol=1e-8)


@pytest.mark.parametrize("seed", [27, 3])
def test_truncated_solve_residual_is_the_true_one_and_the_minimal_residual_solve_never_exceeds_one(seed):
    """6 Lanczos steps on a 40-dim indefinite H with a spread spectrum (the truncated regime the configs ship):
    the reported residual is ||H x - P_kept b|| / ||P_kept b|| computed explicitly; the default
    (minimal-residual) solve keeps it <= 1, where the Galerkin pseudoinverse amplifies an unconverged small
    Ritz value (seed 27: a residual of about 129, far worse than x = 0)."""
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.normal(size=(40, 40)))[0]
    ev = np.r_[rng.uniform(0.01, 1, 30) * np.logspace(0, -3, 30), -rng.uniform(0, 0.5, 10)]
    H, b = torch.tensor(Q @ np.diag(ev) @ Q.T), torch.tensor(rng.normal(size=40))
    galerkin = pinv_solve(lambda v: H @ v, b, iters=6, rtol=1e-3, minimal_residual=False)
    minres = pinv_solve(lambda v: H @ v, b, iters=6, rtol=1e-3)
    P = minres.kept_vectors.T @ (minres.kept_vectors @ b)
    for res in (galerkin, minres):
        assert res.solve_residual == pytest.approx(float((H @ res.solution - P).norm() / P.norm()), rel=1e-6)
    assert minres.solve_residual <= 1.0
    if seed == 27:
        assert galerkin.solve_residual > 100
    assert minres.solve_residual <= galerkin.solve_residual
    # once Krylov is invariant both are the pseudoinverse
    full_g = pinv_solve(lambda v: H @ v, b, iters=41, rtol=1e-9, minimal_residual=False)
    full_m = pinv_solve(lambda v: H @ v, b, iters=41, rtol=1e-9)
    np.testing.assert_allclose(full_m.solution.numpy(), full_g.solution.numpy(), atol=1e-8)
    assert full_m.solve_residual < 1e-6


def test_lanczos_tridiagonal_and_truncation_keeps_top_curvature():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(40, 40))
    H = torch.tensor(A @ A.T)
    b = torch.tensor(rng.normal(size=40))
    Q, T = lanczos(lambda v: H @ v, b, 12)
    assert Q.shape == (12, 40)
    np.testing.assert_allclose((Q @ Q.T).numpy(), np.eye(12), atol=1e-10)
    np.testing.assert_allclose((Q @ H @ Q.T).numpy(), T.numpy(), atol=1e-8)
    # the largest Ritz value converges to the largest eigenvalue first, from below
    top, lam = torch.linalg.eigvalsh(T).max().item(), torch.linalg.eigvalsh(H).max().item()
    assert top <= lam + 1e-9 and top == pytest.approx(lam, rel=1e-3)


def test_hvp_matches_autograd_hessian_on_a_nonquadratic_loss():
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(3, requires_grad=True)

    def loss():
        return (torch.sin(x).sum() * y.pow(2).sum()) + (x[:3] * y).exp().sum()

    hvp = HVP(loss(), [x, y])
    v = torch.randn(8)
    Hfull = torch.autograd.functional.hessian(lambda a, b: (torch.sin(a).sum() * b.pow(2).sum())
                                              + (a[:3] * b).exp().sum(), (x.detach(), y.detach()))
    H = torch.cat([torch.cat([Hfull[0][0], Hfull[0][1]], 1), torch.cat([Hfull[1][0], Hfull[1][1]], 1)], 0)
    torch.testing.assert_close(hvp(v), H @ v)
    assert hvp.count == 1


def test_optimistic_select_only_moves_along_the_solution_set():
    prob = _problem(4)
    w0 = np.array([1.0, 1.0, 1.0])
    _, phi = _exact(w0, *prob)
    # start at the min-norm inner solution
    A = sum(C.T @ C for C in prob[1])
    z = np.linalg.solve(A, sum(C.T @ b for C, b in zip(prob[1], prob[2])))
    y0 = np.linalg.pinv(prob[0]) @ z
    y = torch.tensor(y0, requires_grad=True)
    inner, outer = _closures(*prob, y, torch.tensor(w0))
    g0 = inner().item()
    res = optimistic_select(inner, outer, [y], steps=120, lr=0.4, iters=10, rtol=1e-8, probes=4,
                            generator=torch.Generator().manual_seed(1))
    assert inner().item() == pytest.approx(g0, abs=1e-9)
    assert res.outer_losses[-1] == pytest.approx(phi, rel=1e-6) and phi < res.outer_losses[0]
    assert res.passes["double_backward"] <= 120 * 4 * 10
    assert set(res.flat_dims) == {4}, "four probes certify the whole 4-dim solution set at every step"


# ---------------------------------------------------------------- the selection step finds flat directions


def _psd(seed, d, eigs):
    """H = U diag(eigs, 0, ...) U^T with a random orthonormal U: rank len(eigs) in dimension d."""
    U = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))[0]
    lam = np.zeros(d)
    lam[:len(eigs)] = eigs
    return U @ np.diag(lam) @ U.T, U


def test_flat_directions_from_random_starts_are_certified_null_vectors():
    H, _ = _psd(0, 40, np.geomspace(5.0, 0.5, 6))
    Ht = torch.tensor(H)
    flat = flat_directions(lambda v: Ht @ v, 40, iters=10, flat_rtol=1e-8, probes=5, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(0))
    assert flat.basis.shape == (5, 40)
    np.testing.assert_allclose((flat.basis @ flat.basis.T).numpy(), np.eye(5), atol=1e-10)
    np.testing.assert_allclose((Ht @ flat.basis.T).numpy(), 0, atol=1e-8)  # in the kernel of H
    assert flat.matvecs <= 5 * 10 and flat.scale == pytest.approx(5.0, rel=1e-8)


def test_selection_moves_the_arbitrary_minimizer_to_the_optimistic_one():
    """g(y) = 1/2 (y - a)^T H (y - a) with rank(H) = 3 in R^7: S = a + ker H, a 4-dim affine set of
    minimizers. f(y) = 1/2 ||D (y - c)||^2 picks one point of S (y*); the min-norm minimizer (what a
    solver started at 0 returns, an arbitrary member of S) is far from it. Single random-start probes
    (one flat direction per step) walk along S to y* and never change g."""
    H, U = _psd(3, 7, [4.0, 2.0, 1.0])
    rng = np.random.default_rng(3)
    a, c, D = rng.normal(size=7), 3 * rng.normal(size=7), np.diag(rng.uniform(0.5, 2.0, size=7))
    P0 = U[:, 3:] @ U[:, 3:].T
    N = U[:, 3:]
    y_star = a + N @ np.linalg.solve(N.T @ D @ D @ N, N.T @ D @ D @ (c - a))  # KKT on S
    y_arb = a - P0 @ a  # min-norm point of S
    def f(v):
        return 0.5 * np.sum((D @ (v - c)) ** 2)

    assert np.linalg.norm(y_arb - y_star) > 1.0 and f(y_arb) > f(y_star) + 1.0
    y = torch.tensor(y_arb, requires_grad=True)
    Ht, at, ct, Dt = (torch.tensor(x) for x in (H, a, c, D))

    def inner():
        return 0.5 * (y - at) @ Ht @ (y - at)

    def outer():
        return 0.5 * ((Dt @ (y - ct)) ** 2).sum()

    res = optimistic_select(inner, outer, [y], steps=300, lr=0.4, iters=6, rtol=1e-8, probes=1,
                            generator=torch.Generator().manual_seed(0))
    assert set(res.flat_dims) == {1}
    assert inner().item() == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(y.detach().numpy(), y_star, atol=1e-4)
    assert res.outer_losses[-1] == pytest.approx(f(y_star), rel=1e-6)


def test_truncated_selection_never_moves_along_curvature():
    """rank(H) = 30 in R^60 and 8 Lanczos steps (the configs' regime): b's part outside the Krylov
    space of grad f is mostly curvature, so stepping along it (the old 'null part') raises g. The
    selection steps only along directions certified flat, so g stays at its minimum."""
    H, _ = _psd(1, 60, np.geomspace(10.0, 0.1, 30))
    Ht = torch.tensor(H)
    c = torch.tensor(np.random.default_rng(1).normal(size=60))
    y = torch.zeros(60, requires_grad=True)  # a minimizer of g (g = 0 on ker H)

    def inner():
        return 0.5 * y @ Ht @ y

    def outer():
        return 0.5 * ((y - c) ** 2).sum()

    old = pinv_solve(lambda v: Ht @ v, -c, iters=8, rtol=1e-3).null_part
    assert float(old @ Ht @ old) > 0.05 * float(old @ old), "the old direction had curvature"
    optimistic_select(inner, outer, [y], steps=5, lr=0.5, iters=8, rtol=1e-3, probes=2,
                      generator=torch.Generator().manual_seed(0))
    assert inner().item() < 1e-10


def test_truncated_selection_with_an_invariant_krylov_space_still_finds_the_optimistic_point():
    """Truncated (8 steps, rank 30) but H has only three distinct nonzero eigenvalues, so each random-start
    Krylov space closes after 4 steps and certifies an exact null direction: the walk reaches
    y* = P_ker c, g never moves."""
    H, U = _psd(2, 60, np.repeat([3.0, 1.0, 0.3], 10))
    Ht = torch.tensor(H)
    c = torch.tensor(np.random.default_rng(2).normal(size=60))
    y = torch.zeros(60, requires_grad=True)
    res = optimistic_select(lambda: 0.5 * y @ Ht @ y, lambda: 0.5 * ((y - c) ** 2).sum(), [y], steps=40, lr=1.0,
                            iters=8, rtol=1e-8, probes=10, generator=torch.Generator().manual_seed(0))
    assert set(res.flat_dims) == {10} and res.passes["double_backward"] <= 40 * 10 * 4
    P0 = U[:, 30:] @ U[:, 30:].T
    target = P0 @ c.numpy()
    assert np.linalg.norm(y.detach().numpy() - target) < 1e-2 * np.linalg.norm(target)
    assert 0.5 * float(y @ Ht @ y) < 1e-12


# ---------------------------------------------------------------- hypergradient, truncated regime


def _regression_mixture(seed, d=120, n=40, nt=200):
    """Three sources label the same n inputs (so they conflict and the inner solution set is a
    (d - n)-dim affine set): clean labels, noisy labels, random labels. Target: other inputs, clean.
    Feature scales decay like a network's spectrum."""
    rng = np.random.default_rng(seed)
    s = 1.0 / np.arange(1, d + 1) ** 0.7
    X, Xt, th = rng.normal(size=(n, d)) * s, rng.normal(size=(nt, d)) * s, rng.normal(size=d)
    sd = np.std(X @ th)
    ys = [X @ th, X @ th + rng.normal(size=n) * sd, rng.normal(size=n) * 1.5 * sd]
    return X, Xt, ys, Xt @ th


def _optimistic_point(w, X, Xt, ys, yt):
    """argmin of the target loss over the inner solution set {theta: X theta = ybar_w}, and its value."""
    yb = sum(wk * y for wk, y in zip(w, ys)) / np.sum(w)
    th0 = np.linalg.pinv(X) @ yb
    N = np.linalg.svd(X)[2][X.shape[0]:].T
    th = th0 + N @ np.linalg.lstsq(Xt @ N, yt - Xt @ th0, rcond=None)[0]
    return th, 0.5 * np.mean((Xt @ th - yt) ** 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncated_hypergradient_ranks_sources_like_the_truth(seed):
    """At 4 and 8 Lanczos steps (rank 40, dimension 120) the hypergradient orders the sources as the
    finite-difference derivative of F(w) = f(y*(w)) does: clean most helpful, random labels most harmful."""
    X, Xt, ys, yt = _regression_mixture(seed)
    w0 = np.full(3, 1 / 3)
    fd = np.array([(_optimistic_point(w0 + e, X, Xt, ys, yt)[1] - _optimistic_point(w0 - e, X, Xt, ys, yt)[1])
                   / 2e-6 for e in np.eye(3) * 1e-6])
    assert list(np.argsort(fd)) == [0, 1, 2]
    th_star, _ = _optimistic_point(w0, X, Xt, ys, yt)
    Xs, Xts, yts = torch.tensor(X), torch.tensor(Xt), torch.tensor(yt)
    for iters in (4, 8):
        th, w = torch.tensor(th_star, requires_grad=True), torch.tensor(w0, requires_grad=True)
        hg = hypergradient(
            lambda th=th, w=w: sum(w[k] * 0.5 * ((Xs @ th - torch.tensor(ys[k])) ** 2).mean() for k in range(3)),
            lambda th=th: 0.5 * ((Xts @ th - yts) ** 2).mean(), [th], [w], iters=iters, rtol=1e-6)
        got = hg.grads[0].numpy()
        assert hg.solve.matvecs == iters < 40
        assert list(np.argsort(got)) == [0, 1, 2], (iters, got, fd)
        assert got[0] < 0 < got[2]
        assert np.dot(got, fd) / np.linalg.norm(got) / np.linalg.norm(fd) > 0.9
