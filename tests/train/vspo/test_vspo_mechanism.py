"""VSPO's mechanism: the importance ratio's value and direction, per-group spreads, the intensity generator
across checkpoints, the alignment-derived schedule and its ``steered_share_above_base``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from llmkit.steering import Steering
from llmkit.train.vspo.trainer import group_alphas, scheduled_share_in_range

# the trainer builder and steering vector of test_trainer.py (a test module, so loaded by path)
_spec = importlib.util.spec_from_file_location("vspo_base_tests", Path(__file__).parent / "test_trainer.py")
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
_trainer, _group_batch, vec = _base._trainer, _base._group_batch, _base.vec


def _completion_logps(model, ids, attn, keep):
    """log p(token) of the last ``keep`` tokens, straight from the logits (temperature 1)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -keep - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)


@pytest.mark.parametrize("kind", ["token_truncate", "sequence_truncate"])
def test_importance_ratio_is_pi_over_q_alpha_clipped_and_one_on_unsteered_rows(tmp_path, tiny_model, tiny_tokenizer,
                                                                               vec, kind):
    clip = 1.2  # below some of this seed's per-token ratios, above others
    t = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, importance_correction=kind, importance_clip=clip)
    out = t._generate_and_score_completions(_group_batch())
    alphas = out["steer_alphas"]
    out.pop("old_per_token_logps", None)
    out["advantages"] = torch.ones(alphas.shape[0])  # so the corrected advantages are the ratios themselves
    t._apply_importance_correction(out, alphas, "train")
    ratio = out["advantages"]

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    keep = out["completion_ids"].size(1)
    model = t.accelerator.unwrap_model(t.model)
    with torch.no_grad():
        log_pi = _completion_logps(model, ids, attn, keep)
        with Steering(model, vec, alphas):
            log_q = _completion_logps(model, ids, attn, keep)
    mask = out["completion_mask"].bool()
    log_w = (log_pi - log_q) * mask
    if kind == "sequence_truncate":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    expected = torch.minimum(torch.exp(log_w), torch.tensor(clip))
    steered = (alphas > 0)[:, None] & mask
    torch.testing.assert_close(ratio[steered], expected[steered], rtol=1e-4, atol=1e-5)
    assert torch.all(ratio[~(alphas > 0)] == 1.0)
    # the check has teeth: some steered weights are below 1 and some clipped, so q/pi in place of pi/q fails
    inverse = torch.minimum(torch.exp(-log_w), torch.tensor(clip))
    assert not torch.allclose(inverse[steered], ratio[steered], rtol=1e-3)
    if kind == "token_truncate":
        assert (expected[steered] < 0.99).any() and (expected[steered] == clip).any()


def test_every_group_draws_its_own_spread_and_processes_agree(tmp_path, tiny_model, tiny_tokenizer, vec):
    single = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, alpha_spread="uniform", alpha_max=2.0)
    whole = single.rollout_alphas(16).reshape(4, 4)
    assert (whole[:, 0] == 0).all() and (whole[:, 1:] > 0).all() and (whole <= 2.0).all()
    assert len({tuple(g.tolist()) for g in whole}) == 4, "groups of one batch share a spread"
    halves = []
    for rank in (0, 1):  # two processes, 8 local rows each: together the single process's 16 rows
        t = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, alpha_spread="uniform", alpha_max=2.0)
        t.accelerator = SimpleNamespace(process_index=rank, num_processes=2, unwrap_model=lambda m: m)
        halves.append(t.rollout_alphas(8))
    torch.testing.assert_close(torch.cat(halves), whole.reshape(-1))


def test_intensity_generator_is_saved_with_checkpoints(tmp_path, tiny_model, tiny_tokenizer, vec):
    kw = {"alpha_spread": "uniform", "alpha_max": 3.0}
    straight = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, **kw)
    draws = [straight.rollout_alphas(8) for _ in range(3)]
    first = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, **kw)
    torch.testing.assert_close(first.rollout_alphas(8), draws[0])
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    first._save_rng_state(str(ckpt))  # what Trainer._save_checkpoint calls
    resumed = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, **kw)
    resumed._load_rng_state(str(ckpt))  # what Trainer.train calls on resume
    for want in draws[1:]:
        torch.testing.assert_close(resumed.rollout_alphas(8), want)


def test_aligned_spread_holds_a_share_of_every_group_in_the_range():
    gen = torch.Generator().manual_seed(0)
    for top in (0.0, 0.3, 2.0):
        a = group_alphas(6, top, "aligned", gen, aligned_range=[1.0, 1.5], aligned_share=1 / 3)
        assert a[0] == 0
        inside = ((a >= 1.0) & (a <= 1.5)).sum()
        assert inside >= 2 and (a[3:] <= max(top, 1e-9)).all()
    with pytest.raises(ValueError, match="aligned_range"):
        group_alphas(4, 1.0, "aligned", gen)


def test_scheduled_share_above_base_reproduces_the_issue_count_and_the_aligned_schedule_meets_its_share():
    cfg = SimpleNamespace(mode="vspo", alpha_max=1.5, alpha_anneal="linear", alpha_anneal_fraction=0.75,
                          alpha_final=0.0, alpha_spread="linspace", aligned_share=1 / 3)
    # intensities [0,.5,1,1.5], [0,.33,.67,1], [0,.17,.33,.5], 0: three of 16 rollouts at alpha >= 1
    assert scheduled_share_in_range(cfg, 4, 4, 1.0, 1.5) == pytest.approx(3 / 16)
    cfg.alpha_spread = "aligned"
    share = scheduled_share_in_range(cfg, 4, 4, 1.0, 1.5)
    assert share >= 1 / 3
    # aligned rows (2 of 4) every step, plus the uniform rows' overlap with [1, 1.5] at step 0 (top 1.5)
    assert share == pytest.approx((4 * 2 / 4 + (1 / 3) / 4) / 4)
    cfg.alpha_spread = "uniform"  # two rows uniform on [0, top]: step 0 overlaps [1, 1.5] by a third
    assert scheduled_share_in_range(cfg, 4, 3, 1.0, 1.5) == pytest.approx((2 * (0.5 / 1.5) / 3) / 4)
    cfg.mode = "grpo"
    assert scheduled_share_in_range(cfg, 4, 4, 1.0, 1.5) == 0.0


def test_config_refuses_an_aligned_spread_without_a_usable_range():
    from llmkit.train.vspo.config import VSPOConfig

    base = {"output_dir": "/tmp/x", "use_cpu": True, "report_to": "none", "num_generations": 4,
            "per_device_train_batch_size": 4}
    with pytest.raises(ValueError, match="aligned_alpha_range"):
        VSPOConfig(**base, alpha_spread="aligned")
    with pytest.raises(ValueError, match="aligned_alpha_range"):
        VSPOConfig(**base, aligned_alpha_range=[2.0, 1.0])
    with pytest.raises(ValueError, match="aligned_share"):
        VSPOConfig(**base, alpha_spread="aligned", aligned_alpha_range=[1.0, 2.0], aligned_share=0.9)


def test_rollouts_log_their_share_above_base(tmp_path, tiny_model, tiny_tokenizer, vec):
    t = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, alpha_spread="aligned", aligned_alpha_range=[4.0, 5.0],
                 alpha_max=1.0)
    out = t._generate_and_score_completions(_group_batch())
    a = out["steer_alphas"]
    assert t._metrics["train"]["vspo/share_above_base"][-1] == pytest.approx(float(((a >= 4) & (a <= 5)).float().mean()))
    assert t._metrics["train"]["vspo/share_above_base"][-1] == 0.5  # 2 of each group of 4


def test_alignment_check_can_sample_at_the_rollout_temperature(tiny_model, tiny_tokenizer, vec):
    from llmkit.train.vspo.alignment import measure

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "question": f"What is {i} + 1?",
             "answer": f"#### {i + 1}"} for i in range(3)]
    kw = {"max_new_tokens": 6, "behavior_kwargs": {"min_words": 1, "max_words": 3}}
    greedy = measure(tiny_model, tiny_tokenizer, rows, {"v": vec}, [2.0], "verbosity", **kw)
    hot = measure(tiny_model, tiny_tokenizer, rows, {"v": vec}, [2.0], "verbosity", temperature=1.0, seed=5, **kw)
    again = measure(tiny_model, tiny_tokenizer, rows, {"v": vec}, [2.0], "verbosity", temperature=1.0, seed=5, **kw)
    assert [r["temperature"] for r in greedy] == [0.0, 0.0] and [r["temperature"] for r in hot] == [1.0, 1.0]
    assert [r["samples"] for r in hot] == [r["samples"] for r in again]  # seeded: reproducible
    assert [r["samples"] for r in hot] != [r["samples"] for r in greedy]


@pytest.mark.slow  # three tiny recipe runs: about a minute on the shared CPU
def test_recipe_reports_share_above_base_and_per_step_rollouts_and_resumes_the_same_intensities(tmp_path, repo_root,
                                                                                                 gsm8k_slice):
    from llmkit.cli import main

    def run(out, *extra):
        argv = ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
                "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", "",
                "--max_steps", "3", "--save_steps", "10", "--alpha_spread", "aligned",
                "--aligned_alpha_range", "2.0", "6.0", *extra]
        assert main(argv) == 0
        return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "vspo/alpha_mean" in m]

    straight = run(tmp_path / "a")
    run(tmp_path / "b", "--stop_after_minutes", "0")  # one step, a checkpoint, stop
    pieces = run(tmp_path / "b")  # resumes at step 1
    assert [m["step"] for m in pieces] == [1, 2, 3]
    assert [m["vspo/alpha_mean"] for m in pieces] == pytest.approx([m["vspo/alpha_mean"] for m in straight])
    res = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert res["aligned_alpha_range"] == [2.0, 6.0]
    assert res["steered_share_above_base"] >= 1 / 3
    assert not math.isnan(res["steered_share_above_base"])
    per_step = res["rollouts_per_step"]
    assert [r["step"] for r in per_step] == [1, 2, 3]
    assert all("behavior_reward" in r and r["share_above_base"] >= 0.5 for r in per_step)
