"""LQZO recipe: the group quantizer, the trainable set, the ZO trainer step, save/load/resume, CLI switches."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from torch import nn

from llmkit.train.lqzo import (
    LQZOArguments,
    QuantLinear,
    dequantized_state_dict,
    quantize_model,
    quantize_weight,
)
from llmkit.train.lqzo.trainer import zo_trainable


def test_quantize_weight_codes_range_and_error_shrinks_with_bits():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    errs = {}
    for bits in (2, 4, 8):
        codes, zero, scale = quantize_weight(w, bits, 32)
        assert codes.dtype == torch.uint8 and codes.shape == w.shape and scale.shape == (16, 4)
        assert int(codes.max()) <= 2 ** bits - 1 and torch.equal(zero, zero.round())
        deq = ((codes.view(16, 4, 32).float() - zero[..., None]) * scale[..., None]).view(16, 128)
        errs[bits] = (deq - w).pow(2).mean().item()
    assert errs[8] < errs[4] < errs[2] < w.pow(2).mean().item()
    # the range search is never worse than plain min-max, and helps at 2 bits
    c1, z1, s1 = quantize_weight(w, 2, 32, shrink_grid=(1.0,))
    plain = (((c1.view(16, 4, 32).float() - z1[..., None]) * s1[..., None]).view(16, 128) - w).pow(2).mean().item()
    assert errs[2] < 0.9 * plain
    with pytest.raises(ValueError, match="divide"):
        quantize_weight(w, 4, 48)


@pytest.mark.parametrize("bits", [2, 4])
def test_dequantize_in_place_gives_exactly_codes_minus_zero_times_scale_and_leaves_the_state_alone(bits):
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(bits))
    codes, zero, scale = quantize_weight(w, bits, 32)
    q = QuantLinear(codes, zero, scale * 1.1, None, bits, 32)
    state = [t.clone() for t in (q.codes, q.zero, q.scale.data)]
    ref = ((q.codes.view(24, 3, 32).float() - q.zero[..., None]) * q.scale[..., None]).view(24, 96)
    assert torch.equal(q.dequantize(), ref)
    assert torch.equal(q.dequantize(torch.bfloat16), ref.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(state, (q.codes, q.zero, q.scale.data)))  # nothing written back
    q.scale.requires_grad_(True)  # a first-order user: the in-place ops stay differentiable in the scale
    q.dequantize().sum().backward()
    assert torch.equal(q.scale.grad, (q.codes.view(24, 3, 32).float() - q.zero[..., None]).sum(-1))


def test_quantize_model_replaces_linears_and_dequantized_state_dict_is_a_plain_checkpoint(tiny_model):
    x = torch.randint(0, 200, (2, 10))
    names = quantize_model(tiny_model, 4, 32)
    assert names and all(isinstance(tiny_model.get_submodule(n), QuantLinear) for n in names)
    assert not isinstance(tiny_model.lm_head, QuantLinear)
    q = tiny_model.get_submodule(names[0])
    assert q.scale.shape == (q.out_features, q.in_features // 32)
    assert torch.equal(q(torch.eye(q.in_features)).T, q.dequantize())  # forward uses (codes - zero) * scale
    sd = dequantized_state_dict(tiny_model)
    assert all(not k.endswith((".scale", ".codes", ".zero")) for k in sd)
    from llmkit.testing import tiny_llama

    fresh = tiny_llama(seed=3)
    missing, unexpected = fresh.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    with torch.no_grad():
        assert torch.allclose(fresh(input_ids=x).logits, tiny_model(input_ids=x).logits, atol=1e-5)


def test_trainable_set_is_the_scales_plus_optional_norms(tiny_model):
    quantize_model(tiny_model, 2, 32)
    names, _tensors, modes, _ = zo_trainable(tiny_model, {"train_norms": False})
    assert names and all(n.endswith(".scale") for n in names) and set(modes) == {"mul"}
    names2, _, modes2, _ = zo_trainable(tiny_model, {"train_norms": True})
    extra = set(names2) - set(names)
    assert extra and all("norm" in n for n in extra) and modes2.count("add") == len(extra)
    assert not any(n.endswith(".codes") for n in names2)


def test_full_precision_trainable_set_is_every_weight(tiny_model):
    names, tensors, modes, decay = zo_trainable(tiny_model, {"train_norms": True})
    assert len(names) == len([p for p in tiny_model.parameters()])
    assert set(modes) == {"add"} and all((d == 1.0) == (t.dim() >= 2) for d, t in zip(decay, tensors))


def test_presets_and_switches_resolve_each_piece_independently():
    lq = LQZOArguments().resolved()
    assert (lq["rank"], lq["distribution"], lq["isotropic"], lq["quant_bits"]) == (4, "rademacher", True, 4)
    qz = LQZOArguments(zo_method="qzo").resolved()
    assert (qz["rank"], qz["distribution"], qz["isotropic"]) == (0, "gaussian", False)
    me = LQZOArguments(zo_method="mezo").resolved()
    assert me["quant_bits"] == 0 and me["train_norms"]
    ab = LQZOArguments(zo_method="lqzo", zo_distribution="gaussian", zo_isotropic_groups=False, zo_rank=1,
                       zo_clip=3.0).resolved()
    assert (ab["rank"], ab["distribution"], ab["isotropic"], ab["clip"]) == (1, "gaussian", False, 3.0)
    for bad in ({"zo_method": "adam"}, {"zo_distribution": "uniform"}, {"zo_clip": -1.0}, {"zo_rank": -2}):
        with pytest.raises(ValueError):
            LQZOArguments(**bad)


def test_gradient_optimizers_are_refused_with_a_reason():
    from llmkit.train.lqzo.config import LQZOConfig

    with pytest.raises(ValueError, match="no gradients"):
        LQZOConfig(output_dir="/tmp/x", optim="llmkit_muon", use_cpu=True, report_to="none")


def test_cli_parses_every_switch(repo_root):
    from llmkit.commands.train import parse_method_args

    cfg = str(repo_root / "recipes/configs/lqzo/tiny_cpu.yaml")
    _, (zo, targs, margs) = parse_method_args("lqzo", ["--config", cfg, "--zo_method", "qzo", "--zo_rank", "3",
                                                      "--zo_distribution", "rademacher", "--zo_isotropic_groups",
                                                      "true", "--zo_clip", "5", "--quant_bits", "2"])
    r = zo.resolved()
    assert (r["method"], r["rank"], r["distribution"], r["isotropic"], r["clip"], r["quant_bits"]) == (
        "qzo", 3, "rademacher", True, 5.0, 2)
    assert targs.max_steps == 2 and margs.model_name_or_path == "tiny-llama"
    from llmkit.cli import UserError

    with pytest.raises((UserError, SystemExit)):
        parse_method_args("lqzo", ["--config", cfg, "--zo_distribution", "uniform"])


def _run(tmp_path, data, extra: dict):
    from llmkit.train.lqzo import recipe

    zo = LQZOArguments(dataset_name=str(data), eval_data=str(data), max_eval_samples=2, accuracy_samples=4,
                       quant_group_size=32, **extra.pop("zo", {}))
    from trl import ModelConfig

    from llmkit.train.lqzo.config import LQZOConfig

    kw = {"output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 2,
              "per_device_eval_batch_size": 2, "learning_rate": 1e-2, "logging_steps": 1, "save_strategy": "steps",
              "save_steps": 1, "use_cpu": True, "bf16": False, "dataloader_num_workers": 0, "report_to": "none", "max_length": 128}
    kw.update(extra)
    targs = LQZOConfig(**kw)
    assert recipe.main(zo, targs, ModelConfig(model_name_or_path="tiny-llama")) == 0
    return tmp_path / "out"


def test_tiny_recipe_runs_two_steps_saves_a_loadable_checkpoint_and_resumes(tmp_path, gsm8k_slice):
    out = _run(tmp_path, gsm8k_slice, {"zo": {"zo_method": "lqzo", "zo_rank": 2}})
    res = json.loads((out / "lqzo_results.json").read_text())
    assert res["global_step"] == 2 and res["forward_passes"] == 4 and res["optimizer_state_bytes"] == 0
    assert res["zo"]["rank"] == 2 and res["eval_loss_before"] is not None and res["accuracy_before"] is not None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in lines)
    # the saved folder is an ordinary HF checkpoint whose dense weights are the trained quantized model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    q = load_file(str(out / "lqzo_quant.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    codes, zero, scale = q[f"{name}.codes"], q[f"{name}.zero"], q[f"{name}.scale"]
    g = codes.shape[1] // scale.shape[1]
    w = ((codes.view(codes.shape[0], -1, g).float() - zero[..., None]) * scale[..., None]).view(codes.shape)
    assert torch.equal(dense.get_submodule(name).weight.data, w)
    # the scales moved, the codes did not
    from llmkit.train.lqzo.recipe import prepare_quantized

    ref = AutoModelForCausalLM.from_pretrained(str(out / "tiny-llama"), dtype=torch.float32)
    prepare_quantized(ref, str(out / "tiny-llama"), {"quant_bits": 4, "quant_group_size": 32}, progress=False)
    assert torch.equal(ref.get_submodule(name).codes, codes)
    assert not torch.equal(ref.get_submodule(name).scale.data, scale)
    # resume from checkpoint-2 to step 3: continues the seed stream instead of starting over
    out2 = _run(tmp_path, gsm8k_slice, {"zo": {"zo_method": "lqzo", "zo_rank": 2}, "max_steps": 3,
                                        "resume_from_checkpoint": str(out / "checkpoint-2")})
    assert json.loads((out2 / "lqzo_results.json").read_text())["global_step"] == 3


def test_trainer_step_uses_no_grad_no_state_and_leaves_codes_frozen(tmp_path, gsm8k_slice, tiny_model,
                                                                     tiny_tokenizer):
    from llmkit.train.common import chat_dataset, load_records
    from llmkit.train.lqzo.config import LQZOConfig
    from llmkit.train.lqzo.trainer import LQZOTrainer

    quantize_model(tiny_model, 4, 32)
    codes = {n: b.clone() for n, b in tiny_model.named_buffers() if n.endswith("codes")}
    scales = {n: p.detach().clone() for n, p in tiny_model.named_parameters() if n.endswith("scale")}
    ds = chat_dataset(load_records(str(gsm8k_slice)))
    args = LQZOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
                      use_cpu=True, report_to="none", save_strategy="no", max_length=128, logging_steps=1)
    settings = LQZOArguments(zo_method="lqzo", zo_rank=2).resolved()
    seen_grad = []
    tr = LQZOTrainer(model=tiny_model, args=args, train_dataset=ds, processing_class=tiny_tokenizer,
                     zo_settings=settings)
    tiny_model.register_forward_hook(lambda m, i, o: seen_grad.append(torch.is_grad_enabled()))
    tr.train()
    assert seen_grad and not any(seen_grad), "a training forward ran with autograd on"
    assert len(tr.optimizer.state) == 0 if hasattr(tr.optimizer, "state") else True
    assert all(p.grad is None for p in tiny_model.parameters())
    for n, b in tiny_model.named_buffers():
        if n.endswith("codes"):
            assert torch.equal(b, codes[n])
    assert any(not torch.equal(p.data, scales[n]) for n, p in tiny_model.named_parameters() if n in scales)


@pytest.mark.bundled
@pytest.mark.slow
def test_bundled_model_int2_quantization_loses_and_one_lqzo_step_runs():
    from llmkit.models import load
    from llmkit.optim.zo import SeedZO
    from llmkit.train.lqzo.task import compare_rows

    model, tok = load("smollm2-135m-instruct")
    rows = compare_rows(4, seed=0)
    texts = [tok.apply_chat_template([{"role": "user", "content": r["question"]},
                                      {"role": "assistant", "content": r["answer"]}], tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    with torch.no_grad():
        fp = model(**enc, labels=labels).loss.item()
        quantize_model(model, 2, 64)
        q2 = model(**enc, labels=labels).loss.item()
    assert q2 > fp + 0.1, (fp, q2)
    _, tensors, modes, _ = zo_trainable(model, {})
    zo = SeedZO(tensors, modes=modes, rank=4, distribution="rademacher", isotropic=True)
    before = [t.clone() for t in tensors[:3]]
    with torch.no_grad():
        d = zo.estimate(lambda: model(**enc, labels=labels).loss, 0)
        assert all(torch.equal(a, b) for a, b in zip(before, tensors[:3]))
        zo.update(0, d, lr=1e-3)
    assert all(isinstance(m, nn.Module) for m in model.modules())
    assert not torch.equal(before[0], tensors[0])


def test_accuracy_tasks_are_consistent_and_scored_by_likelihood(tiny_model, tiny_tokenizer):
    from llmkit.train.lqzo.task import NEGATIVE, POSITIVE, choice_accuracy, compare_rows, sentiment_rows

    rows = sentiment_rows(200, seed=1)
    assert 60 < sum(r["label"] for r in rows) < 140
    for r in rows:
        words = POSITIVE if r["label"] == 0 else NEGATIVE
        other = NEGATIVE if r["label"] == 0 else POSITIVE
        assert sum(w in r["question"] for w in words) == 2 and not any(f" {w}," in r["question"] for w in other)
    assert sentiment_rows(5, seed=2) == sentiment_rows(5, seed=2) != sentiment_rows(5, seed=3)
    for r in compare_rows(50, seed=0):
        assert int(r["answer"]) == max(map(int, r["choices"])) == int(r["choices"][r["label"]])
    # scoring is by likelihood: flipping every gold label turns accuracy a into 1 - a (two choices, no ties)
    rows = sentiment_rows(12, seed=4)
    acc = choice_accuracy(tiny_model, tiny_tokenizer, rows)
    flipped = [dict(r, label=1 - r["label"]) for r in rows]
    assert abs(choice_accuracy(tiny_model, tiny_tokenizer, flipped) - (1 - acc)) < 1e-6


def test_a_scale_driven_down_by_a_huge_step_stays_alive_and_moves_back():
    """LQZO's log-space step: the old relative update max(1 - lr g, 0) zeroed a scale for good (a zero scale has a
    zero relative perturbation, so nothing could move it again)."""
    from llmkit.optim.zo import SeedZO

    s = torch.full((8, 6), 0.5)
    zo = SeedZO([s], modes=["mul"], rank=0, distribution="gaussian", seed=3)
    z = zo.z(0, 0, 0)
    zo.update(0, [10.0], lr=1.0)  # a step of -10 z on log s: tiny where z > 0, never 0 or negative
    assert torch.allclose(s, 0.5 * torch.exp(-10 * z))
    assert (s > 0).all() and (s < 0.5 * 1e-3).any() and (s > 0.5).any()
    zo.update(0, [-10.0], lr=1.0)  # the opposite step brings every scale back
    assert torch.allclose(s, torch.full((8, 6), 0.5), rtol=1e-4)
    small = torch.full((8, 6), 0.5)
    SeedZO([small], modes=["mul"], seed=3).update(0, [1e-3], lr=1e-2)  # ordinary steps: the first-order step
    assert torch.allclose(small, 0.5 * (1 - 1e-5 * z))


def test_qzo_baseline_is_additive_clipped_and_projected_onto_nonnegative_scales(tiny_model):
    from llmkit.optim.zo import SeedZO

    qz = LQZOArguments(zo_method="qzo").resolved()
    assert qz["scale_mode"] == "add" and qz["clip"] is not None and qz["clip"] > 0
    lq = LQZOArguments().resolved()
    assert lq["scale_mode"] == "log" and lq["clip"] is None
    assert LQZOArguments(zo_method="qzo", zo_clip=0).resolved()["clip"] is None
    with pytest.raises(ValueError, match="zo_scale_mode"):
        LQZOArguments(zo_scale_mode="exp")
    quantize_model(tiny_model, 4, 32)
    _, _, modes, _ = zo_trainable(tiny_model, qz)
    assert set(modes) == {"add_nonneg"}
    _, _, modes, _ = zo_trainable(tiny_model, lq)
    assert set(modes) == {"mul"}
    # additive perturbation s +- mu z (absolute), and s = max(s - lr g, 0)
    s = torch.full((8, 6), 0.01)
    zo = SeedZO([s], modes=["add_nonneg"], mu=1e-3, seed=4)
    z = zo.z(0, 0, 0)
    zo.perturb(0, 0, 1.0)
    assert torch.allclose(s, 0.01 + 1e-3 * z)
    zo.restore()
    zo.update(0, [2.0], lr=0.01)
    assert torch.allclose(s, (0.01 - 0.02 * z).clamp_min(0), atol=1e-7)
    assert (s == 0).any()


STEPS, TINY_LR = 30, 1.0  # at 0.5 the drop (0.0036 on one CPU) sat at the 0.004 margin; 1.0 gives ~0.037


def _fixed_batch_trainer(tmp_path, model, tok, lr, steps, settings):
    from datasets import Dataset

    from llmkit.train.lqzo.config import LQZOConfig
    from llmkit.train.lqzo.trainer import LQZOTrainer

    row = {"messages": [{"role": "user", "content": "Say the colours."},
                        {"role": "assistant", "content": "red green blue red green blue red green blue"}]}
    ds = Dataset.from_list([row, row])
    args = LQZOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, learning_rate=lr,
                      lr_scheduler_type="constant", use_cpu=True, report_to="none", save_strategy="no",
                      max_length=64, logging_steps=1, seed=0, data_seed=0)
    return LQZOTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds, processing_class=tok,
                       zo_settings=settings)


def test_shipped_lqzo_estimator_lowers_the_loss_on_a_fixed_batch_against_lr_zero(tmp_path, tiny_tokenizer):
    """The trainer with the shipped estimator (the lqzo preset: rank 4, Rademacher, regrouped, v_interval 10,
    log-space scales, eval-mode forwards) descends on a fixed batch; lr 0 is the control (same forwards, no step).
    The lr is sized for the random tiny model, whose scale gradient is orders of magnitude smaller than the
    bundled model's; the bundled model's lr is chosen by bench/lqzo.py's validation sweep."""
    from llmkit.testing import tiny_llama

    settings = LQZOArguments().resolved()
    assert (settings["rank"], settings["v_interval"], settings["scale_mode"]) == (4, 10, "log")
    after = {}
    for lr in (0.0, TINY_LR):
        torch.manual_seed(0)
        model = tiny_llama()
        quantize_model(model, 4, 32)
        tr = _fixed_batch_trainer(tmp_path / str(lr), model, tiny_tokenizer, lr, STEPS, settings)
        before = tr.evaluate()["eval_loss"]
        tr.train()
        after[lr] = tr.evaluate()["eval_loss"]
        if lr == 0.0:
            assert after[lr] == pytest.approx(before, abs=1e-6), "lr 0 changed the loss"
    # deterministic (fixed seeds); a flipped estimator or a step in the wrong coordinates raises the loss instead
    assert after[TINY_LR] < after[0.0] - 0.004, after


def test_zo_forwards_run_in_eval_mode(tmp_path, tiny_tokenizer):
    from llmkit.testing import tiny_llama

    model = tiny_llama()
    quantize_model(model, 4, 32)
    modes = []
    model.register_forward_hook(lambda m, i, o: modes.append(m.training))
    _fixed_batch_trainer(tmp_path, model, tiny_tokenizer, 1e-3, 1, LQZOArguments().resolved()).train()
    assert modes and not any(modes), "a ZO forward ran in train mode (dropout masks would differ within a pair)"


def test_the_zo_loss_on_labelled_positions_only_equals_sft_trainers_loss(tmp_path, tiny_tokenizer):
    """The ZO forwards project only the labelled positions through the LM head; the loss (and SFTTrainer's
    logged metrics) must be what ``SFTTrainer.compute_loss`` gives on the whole sequence, padding included."""
    from datasets import Dataset

    from llmkit.testing import tiny_llama
    from llmkit.train.lqzo.config import LQZOConfig
    from llmkit.train.lqzo.task import accepts_logits_to_keep
    from llmkit.train.lqzo.trainer import LQZOTrainer, label_positions_loss

    model = tiny_llama()
    quantize_model(model, 4, 32)
    rows = [{"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": a}]}
            for q, a in (("Say the colours of the flag, please.", "red"), ("Hi?", "green blue red green"))]
    args = LQZOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                      report_to="none", save_strategy="no", max_length=64, logging_steps=1)
    tr = LQZOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer,
                     zo_settings=LQZOArguments().resolved())
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    labels = batch["labels"]
    kept = int((labels[:, 1:] != -100).any(0).sum())  # positions the head projects: under half of them here
    assert accepts_logits_to_keep(model) and 0 < kept < labels.shape[1] // 2
    model.eval()
    with torch.no_grad():
        for n_items in (None, torch.tensor(11)):
            ref = tr.compute_loss(model, dict(batch), num_items_in_batch=n_items)
            got, m = label_positions_loss(model, dict(batch), n_items)
            assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    ref_metrics = {k: tr._metrics["eval"][k][-1] for k in ("entropy", "mean_token_accuracy")}  # SFTTrainer's
    tr._log_forward_metrics(m)
    assert tr._metrics["train"]["entropy"][-1] == pytest.approx(ref_metrics["entropy"], rel=1e-4)
    assert tr._metrics["train"]["mean_token_accuracy"][-1] == pytest.approx(ref_metrics["mean_token_accuracy"])
    tr._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    assert int(m["count"]) == int((labels[:, 1:] != -100).sum())
    widths = []
    model.lm_head.register_forward_hook(lambda mod, i, o: widths.append(i[0].shape[1]))
    tr.train()  # one ZO step: 2 forwards, each through the head on the labelled positions only
    assert widths == [kept, kept]
    # a training step's metrics are logged as training metrics (the ZO forwards ran in eval mode, the step puts
    # the mode back), the batch's tokens counted once
    logged = tr.state.log_history[0]
    assert model.training and not any(k.startswith("eval_") for k in logged)
    assert logged["num_tokens"] == int(batch["attention_mask"].sum()) and 0 <= logged["mean_token_accuracy"] <= 1
    assert logged["entropy"] > 0


def test_zo_step_through_sft_compute_loss_logs_training_metrics(tmp_path, tiny_tokenizer, monkeypatch):
    """Where the labelled-positions shortcut does not apply, SFTTrainer.compute_loss files each eval-mode forward's
    metrics under "eval": the step moves them to "train", counts the batch's tokens once, restores the mode."""
    from datasets import Dataset

    import llmkit.train.lqzo.trainer as T
    from llmkit.testing import tiny_llama
    from llmkit.train.lqzo.config import LQZOConfig

    monkeypatch.setattr(T, "accepts_logits_to_keep", lambda model: False)
    model = tiny_llama()
    quantize_model(model, 4, 32)
    rows = [{"prompt": [{"role": "user", "content": "Hi?"}], "completion": [{"role": "assistant", "content": "red"}]}]
    args = LQZOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, use_cpu=True,
                      report_to="none", save_strategy="no", max_length=64, logging_steps=1)
    tr = T.LQZOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer,
                       zo_settings=LQZOArguments().resolved())
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    tr.train()
    logged = tr.state.log_history[0]
    assert model.training and not any(k.startswith("eval_") for k in logged) and not tr._metrics["eval"]
    assert logged["num_tokens"] == int(batch["attention_mask"].sum()) and logged["entropy"] > 0


def test_choice_scores_from_the_kept_positions_equal_the_full_logits(tiny_model, tiny_tokenizer):
    from llmkit.train.lqzo.task import choice_scores, compare_rows, sentiment_rows

    rows = sentiment_rows(5, seed=7) + compare_rows(4, seed=7)  # prompts of several lengths in one batch
    got = choice_scores(tiny_model, tiny_tokenizer, rows, batch_size=6)
    ref = torch.empty_like(got)
    with torch.no_grad():
        for i, r in enumerate(rows):
            p = tiny_tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                                   add_generation_prompt=True)
            p_ids = tiny_tokenizer(p, add_special_tokens=False)["input_ids"]
            for j, c in enumerate(r["choices"]):
                ids = p_ids + tiny_tokenizer(c, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
                logp = torch.log_softmax(tiny_model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
                ref[i, j] = logp[torch.arange(len(p_ids) - 1, len(ids) - 1), torch.tensor(ids[len(p_ids):])].sum()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-5)
