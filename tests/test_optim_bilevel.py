"""llmkit.optim.bilevel: pseudoinverse solves, optimistic selection and the hypergradient on a quadratic
bilevel problem whose lower level has an affine (non-isolated) solution set, against finite differences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmkit.optim.bilevel import HVP, hgms_step, hypergradient, lanczos, optimistic_select, pinv_solve


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

    hg, sel = hgms_step(inner, outer, [y], [w], select_steps=300, select_lr=0.2, iters=10, rtol=1e-8)
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
    res = optimistic_select(inner, outer, [y], steps=200, lr=0.2, iters=10, rtol=1e-8)
    assert inner().item() == pytest.approx(g0, abs=1e-9)
    assert res.outer_losses[-1] == pytest.approx(phi, rel=1e-6) and phi < res.outer_losses[0]
    assert res.passes["double_backward"] <= 200 * 10
