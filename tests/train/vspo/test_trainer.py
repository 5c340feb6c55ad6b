"""VSPO trainer: intensity schedule, per-row steering of rollouts, loss on unsteered log-probs, the recipe."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from llmkit.steering import SteeringVector, decoder_layers
from llmkit.train.vspo.trainer import alpha_scale, group_alphas

PROMPTS = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Name a colour."}]]


def test_group_alphas_spread_includes_an_unsteered_rollout():
    torch.testing.assert_close(group_alphas(4, 3.0, "linspace"), torch.tensor([0.0, 1.0, 2.0, 3.0]))
    u = group_alphas(6, 2.0, "uniform", torch.Generator().manual_seed(0))
    assert u[0] == 0 and (u[1:] > 0).all() and (u <= 2.0).all()
    assert group_alphas(1, 5.0, "linspace").tolist() == [0.0]


def test_alpha_anneals_to_final():
    cfg = SimpleNamespace(alpha_anneal="linear", alpha_max=4.0, alpha_final=0.0, alpha_anneal_fraction=0.5)
    assert [alpha_scale(s, 10, cfg) for s in (0, 2, 5, 9)] == pytest.approx([4.0, 2.4, 0.0, 0.0])
    cfg.alpha_anneal = "cosine"
    assert alpha_scale(0, 10, cfg) == pytest.approx(4.0) and alpha_scale(5, 10, cfg) == pytest.approx(0.0)
    cfg.alpha_anneal = "none"
    assert alpha_scale(7, 10, cfg) == 4.0


def _reward_len(completions, **kw):
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def _trainer(tmp_path, model, tok, vec, **overrides):
    from datasets import Dataset

    from llmkit.train.vspo.config import VSPOConfig
    from llmkit.train.vspo.trainer import VSPOTrainer

    kw = {"output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 8, "num_generations": 4,
              "max_completion_length": 8, "max_steps": 10, "report_to": "none", "use_cpu": True, "bf16": False, "beta": 0.0,
              "alpha_max": 6.0, "alpha_anneal": "none", "logging_steps": 1, "seed": 0, "temperature": 1.0}
    kw.update(overrides)
    args = VSPOConfig(**kw)
    ds = Dataset.from_list([{"prompt": p} for p in PROMPTS] * 4)
    trainer = VSPOTrainer(model=model, args=args, reward_funcs=[_reward_len], train_dataset=ds,
                          processing_class=tok, steering_vector=vec)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by training_step in a real run
    return trainer


@pytest.fixture()
def vec(tiny_model):
    torch.manual_seed(3)
    return SteeringVector({1: torch.randn(tiny_model.config.hidden_size) * 4.0})


def _group_batch():
    return [{"prompt": p} for p in PROMPTS for _ in range(4)]  # RepeatSampler order: each prompt G times


def test_rollouts_get_per_row_alphas_and_loss_uses_unsteered_logps(tmp_path, tiny_model, tiny_tokenizer, vec):
    trainer = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec)
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(_group_batch())
    torch.testing.assert_close(out["steer_alphas"], torch.tensor([0.0, 2.0, 4.0, 6.0] * 2))
    assert trainer._metrics["train"]["vspo/alpha_mean"][-1] == pytest.approx(3.0)
    assert all(not layer._forward_hooks for layer in decoder_layers(trainer.model))  # removed after generation

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    keep = out["completion_ids"].size(1)
    seen = {}
    original = trainer._get_per_token_logps_and_entropies

    def spy(model, *a, **k):
        seen["hooks"] = sum(len(layer._forward_hooks) for layer in decoder_layers(model))
        res = original(model, *a, **k)
        seen["logps"] = res[0].detach()
        return res

    trainer._get_per_token_logps_and_entropies = spy
    loss = trainer.compute_loss(trainer.model, out)
    loss.backward()
    trainer._get_per_token_logps_and_entropies = original
    assert seen["hooks"] == 0
    with torch.no_grad():
        plain, _, _ = original(trainer.model, ids, attn, keep, batch_size=8)
        from llmkit.steering import Steering

        with Steering(trainer.model, vec, out["steer_alphas"]):
            steered, _, _ = original(trainer.model, ids, attn, keep, batch_size=8)
    mask = out["completion_mask"].bool()
    torch.testing.assert_close(seen["logps"][mask], plain[mask])
    rows = out["steer_alphas"] > 0
    assert not torch.allclose(seen["logps"][mask & rows[:, None]], steered[mask & rows[:, None]])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


def test_steered_rows_differ_from_unsteered_sampling(tmp_path, tiny_model, tiny_tokenizer, vec):
    """Same seed, same prompts: alpha = 0 rows match plain GRPO's rows, steered rows do not."""
    t1 = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, temperature=1e-3)
    out = t1._generate_and_score_completions(_group_batch())
    t2 = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, temperature=1e-3, mode="grpo")
    base = t2._generate_and_score_completions(_group_batch())
    assert base["steer_alphas"].abs().sum() == 0
    same = [torch.equal(a[m.bool()], b[n.bool()]) for a, m, b, n in
            zip(out["completion_ids"], out["completion_mask"], base["completion_ids"], base["completion_mask"])]
    assert same[0] and same[4]  # unsteered rollouts (alpha 0) equal GRPO's
    assert not all(same[1:4]) and not all(same[5:8])


def test_importance_correction_scales_only_steered_rows(tmp_path, tiny_model, tiny_tokenizer, vec):
    t = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, importance_correction="token_truncate",
                 importance_clip=1.5, scale_rewards="none")
    out = t._generate_and_score_completions(_group_batch())
    adv = out["advantages"]
    assert adv.dim() == 2
    mask = out["completion_mask"].bool()
    for row in (0, 4):  # unsteered rows: the plain advantage on every token
        assert torch.allclose(adv[row][mask[row]], adv[row][mask[row]][0].expand(int(mask[row].sum())))
    assert t._metrics["train"]["vspo/importance_ratio_mean"][-1] <= 1.5 + 1e-6
    t.compute_loss(t.model, out).backward()


def test_answer_positions_steer_rollouts_but_not_their_prompts(tmp_path, tiny_model, tiny_tokenizer, vec):
    """steering_positions answer: the rollout's prompt is read unsteered, so rollouts differ from steering all."""
    from llmkit.steering import Steering

    seen = []
    orig_init = Steering.__init__

    def spy(self, *a, **k):
        orig_init(self, *a, **k)
        seen.append(self.positions)

    Steering.__init__ = spy
    try:
        t = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, temperature=1e-3, steering_positions="answer")
        out = t._generate_and_score_completions(_group_batch())
    finally:
        Steering.__init__ = orig_init
    assert seen == ["answer"]
    t_all = _trainer(tmp_path, tiny_model, tiny_tokenizer, vec, temperature=1e-3)
    full = t_all._generate_and_score_completions(_group_batch())
    assert torch.equal(out["completion_ids"][0], full["completion_ids"][0])  # alpha 0: identical
    from llmkit.train.vspo.config import VSPOConfig

    with pytest.raises(ValueError, match="steering_positions must be one of all, answer"):
        VSPOConfig(output_dir="/tmp/x", steering_positions="prompt", use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="importance_correction"):
        VSPOConfig(output_dir="/tmp/x", steering_positions="answer", importance_correction="token_truncate",
                   use_cpu=True, report_to="none")


def test_vllm_is_refused_for_vspo():
    from llmkit.train.vspo.config import VSPOConfig

    with pytest.raises(ValueError, match="vLLM"):
        VSPOConfig(output_dir="/tmp/x", use_vllm=True, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="mode"):
        VSPOConfig(output_dir="/tmp/x", mode="steer", use_cpu=True, report_to="none")


def _slice_file(tmp_path, gsm8k_slice):
    return str(gsm8k_slice)


def test_tiny_recipe_runs_two_steps_and_resumes(tmp_path, repo_root, gsm8k_slice):
    from llmkit.cli import main

    out = tmp_path / "run"
    argv = ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", str(gsm8k_slice),
            "--verbosity_min_words", "2", "--verbosity_max_words", "4"]
    assert main(argv) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["steps"] == 2 and res["before"]["n"] == 4 and "accuracy" in res["after"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "vspo/alpha_max" in m]
    assert [m["vspo/alpha_max"] for m in steps] == [8.0, 4.0]  # linear annealing over max_steps = 2
    for name in ("resolved_config.yaml", "reward_curves.png", "steering/steering.safetensors",
                 "checkpoint-2/trainer_state.json"):
        assert (out / name).is_file(), name
    # a rerun with more steps picks up checkpoint-2 instead of starting over
    assert main(argv + ["--max_steps", "3", "--eval_path", "", "--save_steps", "3"]) == 0
    state = json.loads((out / "checkpoint-3/trainer_state.json").read_text())
    assert state["global_step"] == 3


def test_tiny_recipe_in_pieces_keeps_the_before_eval(tmp_path, repo_root, gsm8k_slice):
    """--stop_after_minutes 0 stops after the first step with a checkpoint and no final eval; a rerun resumes,
    finishes and keeps the "before" evaluation of the first piece."""
    from llmkit.cli import main

    out = tmp_path / "run"
    argv = ["train", "vspo", "--config", str(repo_root / "recipes/configs/vspo/tiny_cpu.yaml"),
            "--output_dir", str(out), "--dataset_name", str(gsm8k_slice), "--eval_path", str(gsm8k_slice),
            "--max_steps", "3", "--save_steps", "10"]
    assert main(argv + ["--stop_after_minutes", "0"]) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["steps"] == 1 and res["stopped_early"] and res["before"]["n"] == 4 and "after" not in res
    assert json.loads((out / "checkpoint-1/trainer_state.json").read_text())["global_step"] == 1
    before = res["before"]
    assert main(argv) == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["steps"] == 3 and "stopped_early" not in res and res["before"] == before and res["after"]["n"] == 4
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "vspo/alpha_max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]  # no step redone or skipped across the pieces
    assert [m["vspo/alpha_max"] for m in steps] == pytest.approx([8.0, 16 / 3, 8 / 3])  # one schedule over 3 steps
