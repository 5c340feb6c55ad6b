"""VSPO with ``reward_aggregation: locu``: a length constraint handled by LOCU instead of a reward penalty.

A 2-step tiny-model run (metrics logged, step inside the trust region), the config refusals, and the branch's
math on a hand-built softmax policy over four completions with known word counts (exact gradients)."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.train.vspo.trainer import leave_one_out_advantages, locu_constrained_step


@pytest.mark.slow
def test_vspo_tiny_locu_logs_constraint_metrics_and_stays_in_trust_region(repo_root, tmp_path, gsm8k_slice):
    from llmkit.cli import main

    out = tmp_path / "vspo"
    radius = 0.02
    argv = ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", "",
            "--verbosity_min_words", "2", "--verbosity_max_words", "4", "--save_strategy", "no",
            "--reward_aggregation", "locu", "--locu_max_words", "1", "--locu_trust_radius", str(radius),
            "--optim", "sgd", "--learning_rate", "1.0", "--max_grad_norm", "0"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "locu/step_norm" in r]
    assert len(steps) == 2
    for r in steps:
        for k in ("locu/constraint_value", "locu/mean_words", "locu/active", "locu/predicted_value",
                  "locu/reward_gain", "locu/satisfied"):
            assert k in r, k
        assert r["locu/step_norm"] <= radius * (1 + 1e-4) + 1e-7
        assert r["locu/constraint_value"] == pytest.approx(r["locu/mean_words"] - 1.0, abs=1e-5)
        if r["locu/constraint_value"] > 0:  # violated: the step lowers the linearised constraint
            assert r["locu/predicted_value"] < r["locu/constraint_value"]
    assert "rewards/verbosity/mean" in steps[0]


def test_locu_config_refusals():
    from llmkit.train.vspo.config import VSPOConfig

    base = {"output_dir": "/tmp/x", "use_cpu": True, "report_to": "none"}
    with pytest.raises(ValueError, match="locu_max_words"):
        VSPOConfig(**base, reward_aggregation="locu")  # no constraint
    with pytest.raises(ValueError, match="importance_correction"):
        VSPOConfig(**base, reward_aggregation="locu", locu_max_words=20, importance_correction="token_truncate")
    with pytest.raises(ValueError, match="locu_trust_radius"):
        VSPOConfig(**base, reward_aggregation="locu", locu_max_words=20, locu_trust_radius=0.0)
    with pytest.raises(ValueError, match="locu_max_words must be > 0"):
        VSPOConfig(**base, reward_aggregation="locu", locu_max_words=0)
    with pytest.raises(ValueError, match="reward_aggregation locu"):
        VSPOConfig(**base, locu_max_words=20)  # a constraint that sum aggregation would silently ignore
    cfg = VSPOConfig(**base, reward_aggregation="locu", locu_max_words=20, locu_trust_radius=0.1)
    assert cfg.locu_max_words == 20 and cfg.locu_trust_radius == 0.1


def test_leave_one_out_advantages():
    w = torch.tensor([1.0, 2.0, 3.0, 6.0, 10.0, 10.0, 10.0, 10.0])
    a = leave_one_out_advantages(w, 4)
    assert torch.allclose(a[:4], torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0]))
    assert torch.all(a[4:] == 0)  # a group with equal lengths carries no length signal
    assert torch.all(leave_one_out_advantages(w, 1) == 0)


# ---- the branch's math on a softmax policy over 4 completions (exact expectations instead of samples)
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
    from llmkit.optim.constrained import locu_step
    from llmkit.train.vspo.trainer import locu_step_in_span

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
