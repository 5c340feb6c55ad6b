"""VSPO with ``reward_aggregation: locu``: a length constraint handled by LOCU instead of a reward penalty.

A 2-step tiny-model run (metrics logged, step inside the trust region), the config refusals and the length
advantages; the LOCU step itself is tested in tests/optim/test_constrained_span.py."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.train.vspo.trainer import leave_one_out_advantages


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
