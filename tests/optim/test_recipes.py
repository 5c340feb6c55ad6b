"""Every ``optim: llmkit_*`` choice runs the HALO recipe for 2 steps on the tiny model (and moves the weights
the way its optimizer does), and VSPO runs with ``reward_aggregation: upgrad``."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.optim.hf import LLMKIT_OPTIMIZERS


def _halo(repo_root, tmp_path, gsm8k_slice, optim, extra=()):
    from llmkit.cli import main

    out = tmp_path / optim
    argv = ["train", "halo", "--config", str(repo_root / "recipes/configs/halo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--forget_data", "",
            "--save_strategy", "no", "--halo_method", "full", "--optim", optim, *extra]
    assert main(argv) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("optim", LLMKIT_OPTIMIZERS)
def test_halo_tiny_two_steps_with_each_llmkit_optimizer(repo_root, tmp_path, gsm8k_slice, optim):
    from safetensors.torch import load_file

    out = _halo(repo_root, tmp_path, gsm8k_slice, optim)
    res = json.loads((out / "halo_results.json").read_text())
    assert res["global_step"] == 2
    cfg = (out / "resolved_config.yaml").read_text()
    assert f"llmkit_optim: {optim}" in cfg
    start = load_file(str(out / "tiny-llama" / "model.safetensors"))
    end = load_file(str(out / "model.safetensors"))
    key = next(k for k in start if "layers.0.self_attn.q_proj.weight" in k)
    delta = (end[key] - start[key]).float()
    assert delta.abs().max() > 0, "the hidden matrices did not move"
    if optim in ("llmkit_signsgd", "llmkit_lion"):
        # sign methods: each entry moves by +-lr per step (linear schedule from 1e-3 over 2 steps: 1e-3, 5e-4)
        sizes = torch.tensor([0.0, 5e-4, 1e-3, 1.5e-3])
        dist = (delta.abs().flatten()[:, None] - sizes[None]).abs().min(dim=1).values
        assert float(dist.max()) < 1e-6


@pytest.mark.slow
def test_halo_tiny_lora_with_imuon_fixed_rank(repo_root, tmp_path, gsm8k_slice):
    out = _halo(repo_root, tmp_path, gsm8k_slice, "llmkit_imuon",
                ["--use_peft", "true", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj"])
    assert json.loads((out / "halo_results.json").read_text())["global_step"] == 2


@pytest.mark.slow
def test_vspo_tiny_upgrad_logs_per_reward_losses_and_weights(repo_root, tmp_path, gsm8k_slice):
    from llmkit.cli import main

    out = tmp_path / "vspo"
    argv = ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", "",
            "--verbosity_min_words", "2", "--verbosity_max_words", "4", "--save_strategy", "no",
            "--reward_aggregation", "upgrad", "--optim", "llmkit_muon"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "jd/weight/verbosity" in r]
    assert len(steps) == 2
    for r in steps:
        assert "rewards/verbosity/mean" in r and "jd/loss/gsm8k_correctness" in r
        assert r["jd/weight/verbosity"] >= 0 and r["jd/weight/gsm8k_correctness"] >= 0
    assert (out / "reward_curves.png").is_file()


def test_upgrad_with_importance_correction_is_refused():
    from llmkit.train.vspo.config import VSPOConfig

    with pytest.raises(ValueError, match="upgrad"):
        VSPOConfig(output_dir="/tmp/x", reward_aggregation="upgrad", importance_correction="token_truncate",
                   use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="reward_aggregation"):
        VSPOConfig(output_dir="/tmp/x", reward_aggregation="max", use_cpu=True, report_to="none")
