"""VSPO's baselines from the same recipe: reward-shaped GRPO, guidance, teacher-trace distillation (2 steps each on
the tiny config), the behaviour-rate curve and first_step_at_target."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.train.vspo.recipe import first_step_at


def _argv(repo_root, gsm8k_slice, out, *extra):
    return ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", str(gsm8k_slice),
            "--behavior", "confident_answer", "--save_strategy", "no", *extra]


@pytest.mark.parametrize("mode", ["vspo", "grpo"])
def test_trained_modes_run_two_steps_with_a_curve(tmp_path, repo_root, gsm8k_slice, mode):
    from llmkit.cli import main

    out = tmp_path / mode
    assert main(_argv(repo_root, gsm8k_slice, out, "--mode", mode, "--curve_every_steps", "1",
                      "--curve_num_problems", "2", "--target_behavior_rate", "0.5")) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["mode"] == mode and res["steps"] == 2 and res["after"]["n"] == 4
    assert [p["step"] for p in res["curve"]] == [1, 2] and all(p["n"] == 2 for p in res["curve"])
    assert res["first_step_at_target"] == first_step_at(res["curve"], 0.5)
    assert (out / "steering" / "steering.safetensors").is_file() == (mode == "vspo")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    alphas = [m["vspo/alpha_max"] for m in metrics if "vspo/alpha_max" in m]
    assert alphas == ([8.0, 4.0] if mode == "vspo" else [0.0, 0.0])


def test_guidance_mode_trains_nothing_and_evaluates_steered(tmp_path, repo_root, gsm8k_slice):
    from llmkit.cli import main

    out = tmp_path / "guidance"
    assert main(_argv(repo_root, gsm8k_slice, out, "--mode", "guidance", "--guidance_alpha", "8")) == 0
    res = json.loads((out / "eval.json").read_text())
    assert "steps" not in res and res["after"]["alpha"] == 8.0 and res["before"]["alpha"] == 0.0
    assert res["first_step_at_target"] in (0, None)
    assert not (out / "metrics.jsonl").exists()
    # steering changed the greedy answers (a random tiny model at alpha 8 cannot stay the same)
    assert [s["completion"] for s in res["after"]["samples"]] != [s["completion"] for s in res["before"]["samples"]]


def test_teacher_mode_distils_steered_traces_and_evaluates_unsteered(tmp_path, repo_root, gsm8k_slice):
    from llmkit.cli import main
    from llmkit.steering import SteeringVector

    out = tmp_path / "teacher"
    assert main(_argv(repo_root, gsm8k_slice, out, "--mode", "teacher", "--guidance_alpha", "8",
                      "--curve_every_steps", "2", "--curve_num_problems", "2")) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["steps"] == 2 and res["after"]["alpha"] == 0.0
    assert res["teacher"]["traces"] == 2 * 4 and res["teacher"]["kept"] == 8 and res["teacher"]["alpha"] == 8.0
    assert [p["step"] for p in res["curve"]] == [2]
    assert SteeringVector.load(out / "steering").layers == [1]
    assert [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_teacher_traces_come_from_the_steered_model_and_filter(tiny_model, tiny_tokenizer):
    from types import SimpleNamespace

    from llmkit.steering import SteeringVector
    from llmkit.train.vspo.teacher import num_traces, teacher_traces

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 48?"}], "question": f"What is {i} + 48?",
             "answer": f"#### {i + 48}"} for i in range(3)]
    cfg = SimpleNamespace(teacher_num_traces=None, max_steps=1, per_device_train_batch_size=4,
                          gradient_accumulation_steps=1, teacher_alpha=None, guidance_alpha=6.0,
                          teacher_max_new_tokens=6, max_completion_length=8, temperature=1e-3, seed=0,
                          eval_batch_size=4, behavior="confident_answer", teacher_filter="none")
    assert num_traces(cfg) == 4
    torch.manual_seed(0)
    vec = SteeringVector({1: torch.randn(tiny_model.config.hidden_size) * 4.0})
    traces, stats = teacher_traces(tiny_model, tiny_tokenizer, rows, vec, cfg, progress=False)
    assert stats == {"traces": 4, "alpha": 6.0, "behavior_rate": 0.0, "kept": 4}
    assert [t["prompt"] for t in traces] != [] and all(t["completion"][0]["role"] == "assistant" for t in traces)
    plain, _ = teacher_traces(tiny_model, tiny_tokenizer, rows, vec, SimpleNamespace(**{**vars(cfg),
                              "guidance_alpha": 0.0}), progress=False)
    assert sorted(t["completion"][0]["content"] for t in traces) != sorted(t["completion"][0]["content"]
                                                                          for t in plain)
    # the behaviour filter keeps nothing here (a random model never shows it) and falls back to every trace
    cfg.teacher_filter = "behavior"
    kept, stats = teacher_traces(tiny_model, tiny_tokenizer, rows, vec, cfg, progress=False)
    assert stats["filter_fallback"] and len(kept) == 4


def test_first_step_at_and_bad_teacher_config():
    from llmkit.train.vspo.config import VSPOConfig

    curve = [{"step": 4, "behavior_rate": 0.6}, {"step": 2, "behavior_rate": 0.1}, {"step": 6, "behavior_rate": 0.9}]
    assert first_step_at(curve, 0.5) == 4 and first_step_at(curve, 0.95) is None and first_step_at([], 0.5) is None
    with pytest.raises(ValueError, match="teacher_filter"):
        VSPOConfig(output_dir="/tmp/x", mode="teacher", teacher_filter="best", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="target_behavior_rate"):
        VSPOConfig(output_dir="/tmp/x", target_behavior_rate=0.0, use_cpu=True, report_to="none")


def test_concise_answer_config_parses_for_every_mode(repo_root):
    from llmkit.commands.train import parse_method_args

    path = str(repo_root / "recipes/configs/vspo/smollm2_concise_answer_gsm8k.yaml")
    for mode in ("vspo", "grpo", "teacher", "guidance"):
        _, (cfg, _model_args) = parse_method_args("vspo", ["--config", path, "--mode", mode])
        assert cfg.mode == mode and cfg.behavior == "concise_answer" and cfg.curve_every_steps == 10
