"""What every ``torch.optim.Optimizer`` in ``llmkit.optim`` promises, checked once for all of them:
it descends a smooth objective, lr = 0 moves nothing, a parameter without a gradient is left alone,
and a run resumed from ``state_dict`` continues exactly like an uninterrupted one."""

from __future__ import annotations

import copy

import pytest
import torch

from llmkit.optim import IMuon, Lion, MirrorDescent, Muon, MuonLight, SemismoothNewton, SignSGD
from llmkit.optim.zo import RSCZO

# name -> (factory(params, lr), lr that descends in 40 steps, closure kind)
# closure kinds: "backward" (closure calls backward; first-order), "loss" (closure only returns the loss)
OPTIMIZERS = {
    "SignSGD": (lambda ps, lr: SignSGD(ps, lr=lr, momentum=0.9), 0.01, "backward"),
    "Lion": (lambda ps, lr: Lion(ps, lr=lr), 0.01, "backward"),
    "Muon": (lambda ps, lr: Muon(ps, lr=lr), 0.05, "backward"),
    "MuonLight": (lambda ps, lr: MuonLight(ps, lr=lr, weight_decay=0.0), 0.05, "backward"),
    "IMuon": (lambda ps, lr: IMuon(ps, lr=lr, manifold="euclidean", momentum=0.5), 0.05, "backward"),
    "MirrorDescent": (lambda ps, lr: MirrorDescent(ps, lr=lr), 0.05, "backward"),
    "SemismoothNewton": (lambda ps, lr: SemismoothNewton(ps, lr=lr), 1.0, "loss"),
    "RSCZO": (lambda ps, lr: RSCZO(ps, lr=lr, num_directions=4, momentum=0.5,
                                   generator=torch.Generator().manual_seed(0)), 0.01, "loss"),
}


def problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 12, generator=g)
    target = torch.randn(4, 6, generator=g) @ a
    w = torch.nn.Parameter(torch.randn(4, 6, generator=g) * 0.1)
    return w, lambda: ((w @ a - target) ** 2).mean()


def run(opt, w, loss_fn, kind: str, steps: int) -> float:
    def closure():
        if kind == "backward":
            opt.zero_grad()
            loss = loss_fn()
            loss.backward()
            return loss
        return loss_fn()

    for _ in range(steps):
        if kind == "backward":
            closure()
            opt.step()
        else:
            opt.step(closure)
    with torch.no_grad():
        return float(loss_fn())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_descends_a_least_squares_objective(name):
    make, lr, kind = OPTIMIZERS[name]
    w, loss_fn = problem()
    with torch.no_grad():
        start = float(loss_fn())
    end = run(make([w], lr), w, loss_fn, kind, 40)
    assert end < 0.7 * start, f"{name}: loss {start:.4f} -> {end:.4f}"


# SemismoothNewton and Lion (lion-pytorch) refuse lr = 0 at construction
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - {"SemismoothNewton", "Lion"}))
def test_zero_lr_moves_nothing(name):
    make, _, kind = OPTIMIZERS[name]
    w, loss_fn = problem()
    before = w.detach().clone()
    run(make([w], 0.0), w, loss_fn, kind, 3)
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("name", sorted(n for n, (_, _, k) in OPTIMIZERS.items() if k == "backward"))
def test_parameter_without_gradient_is_untouched(name):
    make, lr, kind = OPTIMIZERS[name]
    w, loss_fn = problem()
    idle = torch.nn.Parameter(torch.randn(4, 6))
    before = idle.detach().clone()
    run(make([w, idle], lr), w, loss_fn, kind, 3)
    assert idle.grad is None and torch.equal(idle.detach(), before)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_from_state_dict_matches_an_uninterrupted_run(name):
    make, lr, kind = OPTIMIZERS[name]
    w_full, loss_full = problem()
    opt_full = make([w_full], lr)
    run(opt_full, w_full, loss_full, kind, 6)

    w_a, loss_a = problem()
    opt_a = make([w_a], lr)
    run(opt_a, w_a, loss_a, kind, 3)
    saved = copy.deepcopy(opt_a.state_dict())
    w_b, loss_b = problem()
    with torch.no_grad():
        w_b.copy_(w_a)
    opt_b = make([w_b], lr)
    opt_b.load_state_dict(saved)
    if isinstance(opt_a, RSCZO):  # its random directions come from a user-owned generator, resumed by the user
        opt_b.generator.set_state(opt_a.generator.get_state())
    run(opt_b, w_b, loss_b, kind, 3)
    torch.testing.assert_close(w_b.detach(), w_full.detach(), rtol=1e-5, atol=1e-6)
