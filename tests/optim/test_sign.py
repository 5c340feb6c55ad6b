"""Sign-based optimizers under heavy-tailed gradient noise (the seed's toy setting): SignSGD, Signum and Lion
converge on a least-squares problem with Student-t (df = 1.5, infinite variance) gradient noise, where SGD
with the same step sizes wanders."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim import Lion, SignSGD
from llmkit.optim.sign import tail_index


def heavy_tailed_least_squares(make, lr0: float, seed: int, steps: int = 1000, shape=(8, 8), df: float = 1.5) -> float:
    """min_x 0.5 ||x - x*||^2 from noisy gradients (x - x*) + Student-t noise; linear lr decay from lr0.
    Returns the final relative error ||x - x*|| / ||x*||."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(shape, generator=g)
    noise = torch.distributions.StudentT(df).sample((steps, *shape))
    x = torch.nn.Parameter(torch.zeros(shape))
    opt = make([x], lr0)
    for t in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr0 * (1 - t / steps)
        x.grad = (x.detach() - target) + noise[t]
        opt.step()
    return float((x.detach() - target).norm() / target.norm())


def _errors(make, lr0, seeds=(0, 1, 2)):
    out = []
    for s in seeds:
        torch.manual_seed(100 + s)
        out.append(heavy_tailed_least_squares(make, lr0, s))
    return sum(out) / len(out)


@pytest.fixture(scope="module")
def sgd_error():
    return _errors(lambda p, lr: torch.optim.SGD(p, lr=lr), 0.02)


@pytest.mark.parametrize("name,make", [
    ("signsgd", lambda p, lr: SignSGD(p, lr=lr)),
    ("signum", lambda p, lr: SignSGD(p, lr=lr, momentum=0.9)),
    ("lion", lambda p, lr: Lion(p, lr=lr, betas=(0.9, 0.95))),
])
def test_sign_methods_converge_under_infinite_variance_noise_where_sgd_wanders(name, make, sgd_error):
    err = _errors(make, 0.02)
    assert err < 0.3, f"{name} did not converge: relative error {err:.3f}"
    assert err < 0.5 * sgd_error, f"{name} {err:.3f} is not clearly better than SGD {sgd_error:.3f}"


def test_signsgd_update_is_lr_times_sign_and_decay_is_decoupled():
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    x.grad = torch.tensor([5.0, -1e-6, 0.0])
    SignSGD([x], lr=0.1, weight_decay=0.5).step()
    expected = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.05) - 0.1 * torch.tensor([1.0, -1.0, 0.0])
    assert torch.allclose(x.detach(), expected)


def test_lion_matches_its_update_rule():
    torch.manual_seed(0)
    x = torch.nn.Parameter(torch.randn(6))
    ref = x.detach().clone()
    m = torch.zeros(6)
    opt = Lion([x], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(6)
        x.grad = g.clone()
        opt.step()
        ref = ref * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.8 * m + 0.2 * g)
        m = 0.9 * m + 0.1 * g
    assert torch.allclose(x.detach(), ref, atol=1e-6)


def test_bad_arguments_are_refused():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="momentum"):
        SignSGD(p, lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="betas"):
        Lion(p, lr=0.1, betas=(0.9, 1.5))


def test_tail_index_separates_heavy_from_light_tails():
    torch.manual_seed(0)
    heavy = tail_index(torch.distributions.StudentT(1.5).sample((50_000,)))
    light = tail_index(torch.randn(50_000))
    assert 1.0 < heavy < 2.0, heavy
    assert light > 3.0, light
