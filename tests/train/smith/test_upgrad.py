"""reward_aggregation upgrad in SMITH (and the shared mixin VSPO uses): per-axis losses, Jacobian descent."""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from llmkit.tools import sandbox
from llmkit.train.reward_aggregation import RewardJacobianDescentMixin

needs_sandbox = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")


class _FakeGRPO:
    """Stands in for GRPOTrainer: loss = -mean(advantage_i * score_i(w)), the policy-gradient form."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        scores = self._get_per_token_logps_and_entropies(model, inputs["x"])
        return -(inputs["advantages"] * scores).mean()

    def _get_per_token_logps_and_entropies(self, model, x):
        self.forward_calls += 1
        return x @ model.w


class _Trainer(RewardJacobianDescentMixin, _FakeGRPO):
    def __init__(self, agg):
        self.args = SimpleNamespace(reward_aggregation=agg)
        self.forward_calls = 0
        self._metrics = {"train": defaultdict(list)}
        self.reward_func_names = ["schema_reward", "code_reward", "outcome_reward"]
        self.loss_is_scaled_for_ga = True


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def _per_axis_grads(trainer, model, inputs):
    adv = inputs["advantages_per_reward"]
    grads = []
    for k in range(adv.shape[1]):
        model.zero_grad()
        _FakeGRPO.compute_loss(trainer, model, {**inputs, "advantages": adv[:, k]}).backward()
        grads.append(model.w.grad.clone())
    return torch.stack(grads)


def test_upgrad_direction_helps_every_conflicting_axis_from_one_forward_pass():
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(6, 3)
    adv = torch.tensor([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.5], [0.5, -2.0, 1.0],
                        [-0.5, 2.0, -1.0], [1.0, -1.0, 0.0], [-1.0, 1.0, -0.5]])
    inputs = {"x": x, "advantages_per_reward": adv}
    trainer = _Trainer("upgrad")
    jac = _per_axis_grads(trainer, model, inputs)
    assert (jac @ jac.T).min() < 0  # the axes really conflict
    model.zero_grad()
    trainer.forward_calls = 0
    trainer.compute_loss(model, inputs)
    assert trainer.forward_calls == 1  # the three losses share one forward pass
    d = model.w.grad
    assert d.norm() > 0
    assert (jac @ d >= -1e-4 * jac.norm(dim=1).max() * d.norm()).all()  # a descent direction for every loss
    summed = jac.sum(0)
    assert not torch.allclose(d / d.norm(), summed / summed.norm(), atol=1e-3)  # not the plain sum
    for name in trainer.reward_func_names:
        assert len(trainer._metrics["train"][f"jd/loss/{name}"]) == 1


def test_upgrad_with_one_applicable_axis_follows_that_axis():
    model = _Model()
    x = torch.randn(4, 3)
    adv = torch.zeros(4, 3)
    adv[:, 2] = torch.tensor([1.0, -1.0, 0.5, -0.5])  # schema and code skipped every row (advantage 0)
    inputs = {"x": x, "advantages_per_reward": adv}
    trainer = _Trainer("upgrad")
    g = _per_axis_grads(trainer, model, inputs)[2]
    model.zero_grad()
    trainer.compute_loss(model, inputs)
    d = model.w.grad
    assert torch.allclose(d / d.norm(), g / g.norm(), atol=1e-4)


def test_sum_aggregation_leaves_the_grpo_loss_alone():
    model = _Model()
    trainer = _Trainer("normalize_then_sum")
    x = torch.randn(2, 3)
    loss = trainer.compute_loss(model, {"x": x, "advantages": torch.tensor([1.0, -1.0]),
                                        "advantages_per_reward": torch.ones(2, 3)})
    assert loss.requires_grad and model.w.grad is None  # nothing written behind the Trainer's back


def test_smith_per_axis_advantages_skip_rows_an_axis_does_not_apply_to():
    from llmkit.train.smith.trainer import SmithTrainer

    t = SmithTrainer.__new__(SmithTrainer)
    t.num_generations, t.scale_rewards = 2, "group"
    t.reward_weights = torch.tensor([1.0, 1.0, 2.0])
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan, 0.0], [0.0, nan, 1.0], [nan, 1.0, nan], [nan, 0.0, nan]])
    adv = t.per_reward_advantages(rewards)
    assert not torch.isnan(adv).any()
    assert adv[0, 1] == 0 and adv[1, 1] == 0 and adv[2, 0] == 0 and adv[2, 2] == 0
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 1] > 0 > adv[3, 1]
    assert adv[0, 2] == pytest.approx(-2 * adv[0, 0]) and adv[1, 2] == pytest.approx(2 * adv[0, 0])  # weight 2


def test_rows_an_axis_skips_add_nothing_to_that_axis_gradient():
    """End to end through the mixin: a None (NaN) reward row's inputs do not move that axis's gradient."""
    torch.manual_seed(1)
    trainer = _Trainer("upgrad")
    trainer.num_generations, trainer.scale_rewards = 3, "group"
    trainer.reward_weights = torch.ones(2)
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan], [0.0, 2.0], [0.5, 0.0], [nan, 1.0], [1.0, 3.0], [0.0, nan]])
    adv = trainer.per_reward_advantages(rewards)
    model = _Model()
    x = torch.randn(6, 3)
    g = _per_axis_grads(trainer, model, {"x": x, "advantages_per_reward": adv})
    for row, skipped_by, used_by in ((0, 1, 0), (3, 0, 1)):
        x2 = x.clone()
        x2[row] += 10.0
        g2 = _per_axis_grads(trainer, model, {"x": x2, "advantages_per_reward": adv})
        assert torch.allclose(g2[skipped_by], g[skipped_by])  # the skipping axis ignores the row
        assert not torch.allclose(g2[used_by], g[used_by])  # the other axis does see it


def test_config_accepts_upgrad_and_names_a_bad_value(tmp_path):
    from llmkit.train.smith.config import SmithConfig

    kw = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": "none",
          "per_device_train_batch_size": 2, "num_generations": 2}
    c = SmithConfig(reward_aggregation="upgrad", outcome_weight=2.0, **kw)
    assert c.reward_weights == [1.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="reward_aggregation.*upgrad"):
        SmithConfig(reward_aggregation="upgrade", **kw)


@needs_sandbox
def test_tiny_smith_run_with_upgrad_logs_each_axis(tmp_path, repo_root, monkeypatch):
    from llmkit.cli import main

    monkeypatch.chdir(repo_root)
    out = tmp_path / "run"
    rc = main(["train", "smith", "--config", "recipes/configs/smith/tiny_cpu.yaml", "--output_dir", str(out),
               "--reward_aggregation", "upgrad"])
    assert rc == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rewards/schema_reward/mean" in m]
    assert len(steps) == 2
    for m in steps:
        for axis in ("schema_reward", "code_reward", "outcome_reward"):
            assert f"jd/loss/{axis}" in m and f"jd/weight/{axis}" in m
            assert 0.0 <= m[f"rewards/{axis}/group_spread"] <= 1.0
        assert -1.0 <= m["reward_conflict/schema_reward__outcome_reward/cos"] <= 1.0
    assert json.loads((out / "eval.json").read_text())["reward_aggregation"] == "upgrad"


def test_reward_conflict_stats_sees_spread_and_opposed_rankings():
    from llmkit.train.reward_aggregation import reward_conflict_stats

    nan = float("nan")
    # group 1: a and b rank the rollouts oppositely; group 2: they agree; group 3: b has no spread (a NaN row)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5],
                            [0.0, 0.0], [1.0, 2.0], [2.0, 4.0],
                            [1.0, 0.3], [0.0, 0.3], [2.0, nan]])
    s = reward_conflict_stats(rewards, 3, ["a", "b"])
    assert s["rewards/a/group_spread"] == pytest.approx(1.0)
    assert s["rewards/b/group_spread"] == pytest.approx(2 / 3)
    assert s["reward_conflict/a__b/cos"] == pytest.approx((-1.0 + 1.0) / 2)
    assert s["reward_conflict/a__b/frac_opposed"] == pytest.approx(1 / 3)
    same = reward_conflict_stats(torch.ones(4, 2), 2, ["a", "b"])
    assert same["rewards/a/group_spread"] == 0 and same["reward_conflict/a__b/cos"] == 0
    with pytest.raises(ValueError, match="groups of 3"):
        reward_conflict_stats(torch.ones(4, 2), 3, ["a", "b"])
    with pytest.raises(ValueError, match=r"rewards \['a'\]"):
        reward_conflict_stats(torch.ones(4, 2), 2, ["a"])
