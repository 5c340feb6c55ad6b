"""LOCU's identity-Fisher step for large models (``llmkit.optim.constrained``): ``locu_step_in_span`` solves the
same problem as ``locu_step`` in the span's coordinates, and ``locu_constrained_step`` turns a reward loss and a
constraint surrogate into that step written into ``.grad`` (what VSPO's ``reward_aggregation: locu`` does per
micro-batch), checked on a hand-built softmax policy over four completions with exact gradients."""

from __future__ import annotations

import pytest
import torch

from llmkit.optim.constrained import flat_grads, locu_constrained_step, locu_step, locu_step_in_span


def test_flat_grads_fills_unused_parameters_with_zeros_and_keeps_float64():
    a = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(3))
    grads = torch.autograd.grad((a * 2).sum(), [a, b], allow_unused=True)
    v = flat_grads(grads, [a, b])
    assert v.dtype == torch.float64 and v.tolist() == [2.0] * 4 + [0.0] * 3
    assert flat_grads([torch.ones(2)], [torch.nn.Parameter(torch.ones(2))]).dtype == torch.float32


# ---- a softmax policy over 4 completions with known word counts (exact expectations instead of samples)
WORDS = torch.tensor([4.0, 10.0, 25.0, 40.0], dtype=torch.float64)
REWARD = torch.tensor([0.2, 0.5, 0.9, 1.0], dtype=torch.float64)  # longer answers score higher: the conflict


def _policy_case(theta0, limit, radius):
    theta = torch.nn.Parameter(torch.tensor(theta0, dtype=torch.float64))
    pi = torch.softmax(theta, 0)
    reward_loss = -(pi @ REWARD)                  # descending it raises the reward
    surrogate = pi @ WORDS                        # the constraint grows along its gradient
    c = float(pi.detach() @ WORDS) - limit
    step, info = locu_constrained_step([theta], reward_loss, surrogate, c, radius)
    return theta, step, info, c


def _expected(theta, v):
    with torch.no_grad():
        return float(torch.softmax(theta, 0) @ v)


@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_locu_step_writes_minus_step_into_grad(grad_scale):
    theta = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    pi = torch.softmax(theta, 0)
    theta.grad = torch.full((4,), 0.25, dtype=torch.float64)  # an earlier micro-batch's contribution
    step, _ = locu_constrained_step([theta], -(pi @ REWARD), pi @ WORDS, float(pi.detach() @ WORDS) - 10, 0.1,
                                    grad_scale=grad_scale)
    assert torch.allclose(theta.grad, 0.25 - grad_scale * step)


def test_locu_step_violated_constraint_shortens_completions():
    # mass on the long answers: mean words about 33 > L = 15
    theta, step, info, c = _policy_case([0.0, 0.0, 2.0, 2.5], 15.0, 0.3)
    assert c > 0 and info.mode in ("optimize", "recover")
    assert float(step.norm()) <= 0.3 * (1 + 1e-9)
    assert info.predicted_values[0] < c                      # the linearisation is reduced
    before = _expected(theta, WORDS)
    torch.optim.SGD([theta], lr=1.0).step()                   # the HF optimizer's move: theta - lr * grad = theta + s
    assert torch.allclose(theta.detach(), torch.tensor([0.0, 0.0, 2.0, 2.5], dtype=torch.float64) + step)
    assert _expected(theta, WORDS) < before                   # and so is the true mean length


def test_locu_step_feasible_iterate_increases_reward_and_keeps_the_constraint():
    # mass on short answers: mean words about 8 < L = 20; the reward pulls toward long answers
    theta, _step, info, c = _policy_case([2.0, 1.0, -1.0, -2.0], 20.0, 0.2)
    assert c < 0
    assert info.reward_gain > 0 and info.predicted_values[0] <= 1e-9
    r0 = _expected(theta, REWARD)
    torch.optim.SGD([theta], lr=1.0).step()
    assert _expected(theta, REWARD) > r0
    assert _expected(theta, WORDS) - 20.0 <= 0.05             # stays feasible up to second-order terms


def test_locu_step_binding_constraint_beats_unconstrained_ascent_on_the_constraint():
    # near the boundary the unconstrained trust-region ascent step would break the limit; LOCU's does not
    theta0 = [1.0, 1.0, 0.2, -0.5]
    pi = torch.softmax(torch.tensor(theta0, dtype=torch.float64), 0)
    limit = float(pi @ WORDS) + 0.5
    _theta, step, info, c = _policy_case(theta0, limit, 0.5)
    assert info.predicted_values[0] == pytest.approx(0.0, abs=1e-8)   # active: it sits on the boundary
    J = pi * (REWARD - pi @ REWARD)                                    # d E[reward] / d theta
    Jw = pi * (WORDS - pi @ WORDS)
    ascent = 0.5 * J / J.norm()
    assert c + float(Jw @ ascent) > 0                                  # the penalty-free step would violate
    assert float(J @ step) > 0                                         # LOCU still gains reward


@pytest.mark.parametrize("case", ["violated", "satisfied", "zero_reward", "collinear"])
def test_locu_step_in_span_matches_locu_step_on_the_full_vectors(case):
    gen = torch.Generator().manual_seed(0)
    d = 300
    g = torch.randn(d, generator=gen, dtype=torch.float64)
    b = torch.randn(d, generator=gen, dtype=torch.float64) + 0.5 * g
    c = {"violated": 2.0, "satisfied": -0.5, "zero_reward": 3.0, "collinear": 1.0}[case]
    if case == "zero_reward":
        g = torch.zeros(d, dtype=torch.float64)
    if case == "collinear":
        b = -2.0 * g
    ref, ref_info = locu_step(g, b[None], torch.tensor([c]), None, 0.1, return_info=True)
    s, info = locu_step_in_span(g, b[None], torch.tensor([c]), 0.1, chunk=64)
    assert torch.allclose(s, ref, atol=1e-9, rtol=1e-7)
    assert info.mode == ref_info.mode
    assert info.predicted_values[0] == pytest.approx(ref_info.predicted_values[0], abs=1e-8)
    assert float(s.norm()) <= 0.1 * (1 + 1e-12)
    zero, _ = locu_step_in_span(torch.zeros(d), torch.zeros(1, d), torch.tensor([1.0]), 0.1)
    assert torch.all(zero == 0)
