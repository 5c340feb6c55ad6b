"""Jacobian descent: UPGrad's direction never conflicts with an objective (the mean does), IWRM, and VSPO's
per-reward advantages."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim import jd


def _conflicting(seed, m=3, d=6):
    """Objectives of very different scales: the mean gradient follows the big one and can oppose the others."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.Parameter(torch.randn(d, generator=g, dtype=torch.float64))
    targets = _targets(seed, m, d)
    scales = torch.tensor([10.0] + [1.0] * (m - 1), dtype=torch.float64)
    losses = [s * ((x - t) ** 2).sum() for s, t in zip(scales, targets)]
    return x, losses


def _grads(x, losses):
    return torch.stack([torch.autograd.grad(l, x, retain_graph=True)[0] for l in losses])


def test_upgrad_direction_has_nonnegative_inner_product_with_every_gradient_where_the_mean_does_not():
    found_mean_conflict = 0
    for seed in range(20):
        x, losses = _conflicting(seed)
        jac = _grads(x, losses)
        jd.backward(losses, [x], aggregator="upgrad")
        d = x.grad
        scale = jac.norm(dim=1).max() * d.norm()
        assert (jac @ d >= -1e-3 * scale).all(), (seed, jac @ d)
        found_mean_conflict += bool(((jac @ jac.mean(0)) < 0).any())
    assert found_mean_conflict > 0, "the toy never produced a conflict: the test could not fail"


def test_single_loss_gives_its_gradient_and_grads_accumulate():
    x = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    jd.backward([(x ** 2).sum()], [x])
    assert torch.allclose(x.grad, torch.tensor([2.0, 4.0]))
    jd.backward([(x ** 2).sum()], [x])
    assert torch.allclose(x.grad, torch.tensor([4.0, 8.0]))


def test_agreeing_objectives_keep_the_common_direction():
    x = torch.nn.Parameter(torch.tensor([1.0, 0.0], dtype=torch.float64))
    w = jd.backward_with_weights([(2 * x).sum(), (3 * x).sum()], [x])
    assert torch.allclose(x.grad / x.grad.norm(), torch.tensor([1.0, 1.0], dtype=torch.float64) / 2 ** 0.5)
    assert (w > 0).all()


def test_jacobian_descent_lowers_every_objective_on_conflicting_quadratics():
    x, losses = _conflicting(7)
    targets = _targets(7)
    scales = torch.tensor([10.0, 1.0, 1.0], dtype=torch.float64)

    def objectives():
        return [s * ((x - t) ** 2).sum() for s, t in zip(scales, targets)]

    start = torch.stack([l.detach() for l in losses])
    opt = torch.optim.SGD([x], lr=0.002)
    for _ in range(30):
        opt.zero_grad()
        ls = objectives()
        prev = torch.stack([l.detach() for l in ls])
        jd.backward(ls, [x])
        opt.step()
        now = torch.stack([l.detach() for l in objectives()])
        assert (now <= prev + 1e-6 * prev.abs().max()).all(), "a step increased one of the objectives"
    assert (now <= start).all()


def _targets(seed, m=3, d=6):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(m, d, generator=g, dtype=torch.float64) * 3


def test_iwrm_treats_each_example_as_an_objective():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(3))
    xs, ys = torch.randn(5, 3), torch.randn(5)
    per_example = (xs @ w - ys) ** 2
    jac = torch.stack([torch.autograd.grad(l, w, retain_graph=True)[0] for l in per_example])
    jd.iwrm_backward(per_example, [w])
    assert (jac @ w.grad >= -1e-4 * jac.norm(dim=1).max() * w.grad.norm()).all()
    with pytest.raises(ValueError, match="1-D"):
        jd.iwrm_backward(per_example.sum(), [w])


def test_unknown_aggregator_is_refused():
    x = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="unknown aggregator"):
        jd.backward([x.sum(), (x ** 2).sum()], [x], aggregator="bogus")


def test_vspo_per_reward_advantages_normalise_each_reward_within_its_group():
    from llmkit.train.vspo.trainer import VSPOTrainer

    trainer = VSPOTrainer.__new__(VSPOTrainer)
    trainer.num_generations = 2
    trainer.scale_rewards = "group"
    trainer.reward_weights = torch.tensor([1.0, 0.5])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, float("nan")], [2.0, 1.0]])
    adv = trainer.per_reward_advantages(rewards)
    assert adv[0, 0] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-4), rel=1e-4) and adv[1, 0] == pytest.approx(-adv[0, 0])
    assert adv[0, 1] == 0 and adv[1, 1] == 0  # no spread in reward 2 within group 1
    assert adv[2, 0] == 0 and adv[3, 0] == 0  # equal rewards
    assert adv[2, 1] == 0 and adv[3, 1] == 0  # a reward that skipped a row (NaN) gives no signal here
