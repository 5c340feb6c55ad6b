"""IMuon: iterates stay on their manifold and decrease the seed's known costs; the fixed-rank step is invariant
to re-factoring a LoRA pair (B, A) -> (B G, G^-1 A)."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim import IMuon, imuon_lora_param_groups
from llmkit.optim.imuon import lmo

D = torch.float64


def _sym(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=D)
    return m + m.T


def _run(params, loss_fn, opt, steps, decay=0.99):
    lr0 = opt.param_groups[0]["lr"]
    for t in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        for g in opt.param_groups:
            g["lr"] = lr0 * decay ** (t + 1)
    return float(loss_fn())


@pytest.mark.parametrize("norm", ["spectral", "frobenius", "nuclear"])
def test_stiefel_brockett_stays_orthonormal_and_reaches_the_minimum(norm):
    n, p = 8, 3
    a = _sym(n, 0)
    nmat = torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=D))
    x = torch.nn.Parameter(torch.linalg.qr(torch.randn(n, p, dtype=D, generator=torch.Generator().manual_seed(1)))[0])
    cost = lambda: torch.trace(x.T @ a @ x @ nmat)
    start = float(cost())
    opt = IMuon([x], lr=0.05, manifold="stiefel", norm=norm)
    worst = 0.0
    for _ in range(6):
        _run([x], cost, opt, 50)
        worst = max(worst, float((x.T @ x - torch.eye(p, dtype=D)).abs().max()))
    optimum = float((torch.linalg.eigvalsh(a)[:p] * torch.tensor([3.0, 2.0, 1.0], dtype=D)).sum())
    assert worst < 1e-5
    assert float(cost()) < start
    tol = 0.2 if norm == "nuclear" else 0.05  # the nuclear LMO moves one singular direction at a time
    assert float(cost()) - optimum < tol * (start - optimum), (float(cost()), optimum, start)


def test_grassmann_rayleigh_quotient_finds_the_bottom_eigenspace():
    n, p = 10, 2
    a = _sym(n, 2)
    x = torch.nn.Parameter(torch.linalg.qr(torch.randn(n, p, dtype=D, generator=torch.Generator().manual_seed(3)))[0])
    cost = lambda: torch.trace(x.T @ a @ x)
    start = float(cost())
    opt = IMuon([x], lr=0.1, manifold="grassmann")
    final = _run([x], cost, opt, 300)
    assert float((x.T @ x - torch.eye(p, dtype=D)).abs().max()) < 1e-5
    optimum = float(torch.linalg.eigvalsh(a)[:p].sum())
    assert final < start and final - optimum < 1e-3 * (start - optimum)


def test_spd_log_det_objective_converges_to_the_inverse_and_stays_positive_definite():
    g = torch.Generator().manual_seed(4)
    m = torch.randn(4, 4, generator=g, dtype=D)
    s = m @ m.T + torch.eye(4, dtype=D)
    x = torch.nn.Parameter(torch.eye(4, dtype=D))
    cost = lambda: torch.trace(s @ x) - torch.logdet(x)
    opt = IMuon([x], lr=0.1, manifold="spd")
    mins = []
    for _ in range(6):
        _run([x], cost, opt, 50, decay=0.98)
        mins.append(float(torch.linalg.eigvalsh(x.detach()).min()))
    assert min(mins) > 0 and torch.allclose(x.detach(), x.detach().T)
    assert torch.allclose(x.detach(), torch.linalg.inv(s), atol=1e-3)


def _fixed_rank_run(b0, a0, target, norm, momentum, steps=3):
    b, a = torch.nn.Parameter(b0.clone()), torch.nn.Parameter(a0.clone())
    opt = IMuon([{"params": [b, a], "manifold": "fixed_rank"}], lr=0.1, norm=norm, momentum=momentum)
    for _ in range(steps):
        opt.zero_grad()
        ((b @ a - target) ** 2).sum().backward()
        opt.step()
    return (b @ a).detach()


@pytest.mark.parametrize("norm", ["spectral", "frobenius", "nuclear"])
def test_fixed_rank_update_is_invariant_to_refactoring(norm):
    g = torch.Generator().manual_seed(5)
    m, n, r = 7, 5, 2
    b, a, target = (torch.randn(m, r, generator=g, dtype=D), torch.randn(r, n, generator=g, dtype=D),
                    torch.randn(m, n, generator=g, dtype=D))
    gmat = torch.randn(r, r, generator=g, dtype=D) + 3 * torch.eye(r, dtype=D)
    x1 = _fixed_rank_run(b, a, target, norm, 0.9)
    x2 = _fixed_rank_run(b @ gmat, torch.linalg.solve(gmat, a), target, norm, 0.9)
    assert torch.allclose(x1, x2, atol=1e-9)
    assert torch.linalg.matrix_rank(x1) == r
    # plain gradient descent on the factors is NOT invariant (the test can tell the difference)
    def factor_gd(b_, a_):
        bb, aa = torch.nn.Parameter(b_.clone()), torch.nn.Parameter(a_.clone())
        o = torch.optim.SGD([bb, aa], lr=0.01)
        for _ in range(3):
            o.zero_grad()
            ((bb @ aa - target) ** 2).sum().backward()
            o.step()
        return (bb @ aa).detach()
    assert not torch.allclose(factor_gd(b, a), factor_gd(b @ gmat, torch.linalg.solve(gmat, a)), atol=1e-3)


def test_fixed_rank_decreases_the_loss_and_lora_groups_pair_b_with_a(tiny_model):
    g = torch.Generator().manual_seed(6)
    target = torch.randn(6, 6, generator=g, dtype=D)
    b, a = torch.randn(6, 2, generator=g, dtype=D), torch.randn(2, 6, generator=g, dtype=D)
    before = float(((b @ a - target) ** 2).sum())
    after = float(((_fixed_rank_run(b, a, target, "spectral", 0.0, steps=30) - target) ** 2).sum())
    assert after < 0.9 * before

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    groups = imuon_lora_param_groups(model)
    n_layers = model.config.num_hidden_layers
    assert len(groups) == 2 * n_layers
    for grp in groups:
        bw, aw = grp["params"]
        assert grp["manifold"] == "fixed_rank" and bw.shape[1] == aw.shape[0] == 4
    opt = IMuon(groups, lr=1e-2)
    ids = torch.randint(0, 200, (2, 10))
    l0 = model(input_ids=ids, labels=ids).loss.item()
    for _ in range(3):  # first step: B = 0 (rank deficient) takes the per-factor fallback, then fixed-rank steps
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert model(input_ids=ids, labels=ids).loss.item() < l0


def test_lmo_properties():
    torch.manual_seed(0)
    k = torch.randn(5, 3, dtype=D)
    assert torch.allclose(torch.linalg.svdvals(lmo(k, "spectral")), torch.ones(3, dtype=D))
    assert torch.isclose(lmo(k, "frobenius").norm(), torch.tensor(1.0, dtype=D))
    assert torch.isclose(torch.linalg.matrix_norm(lmo(k, "nuclear"), "nuc"), torch.tensor(1.0, dtype=D))
    for norm in ("spectral", "frobenius", "nuclear"):  # each is the maximizer of <K, D> on its unit ball:
        d = lmo(k, norm)
        dual = {"spectral": torch.linalg.matrix_norm(k, "nuc"), "frobenius": k.norm(),
                "nuclear": torch.linalg.matrix_norm(k, 2)}[norm]
        assert torch.isclose((k * d).sum(), dual)
    w = torch.randn(6, 6, dtype=D)
    assert torch.allclose(lmo(w - w.T, "spectral"), -lmo(w - w.T, "spectral").T)  # skew stays skew


def test_bad_manifold_or_pairs_are_refused():
    with pytest.raises(ValueError, match="manifold"):
        IMuon([torch.nn.Parameter(torch.eye(3))], lr=0.1, manifold="sphere")
    with pytest.raises(ValueError, match="pairs"):
        IMuon([{"params": [torch.nn.Parameter(torch.ones(3, 2))], "manifold": "fixed_rank"}], lr=0.1)
