"""Teacher-trace distillation, the VSPO paper's third baseline (``mode: teacher``).

Paper: "Vector-Steered Policy Optimization" (VSPO, NeurIPS 2026) compares VSPO
with "reward shaping, teacher-trace distillation, and guidance-based baselines". Here the teacher is the
starting model itself under its steering vector, the same vector and intensity that guidance uses:

  1. Sample one completion per training prompt from the steered model (``teacher_alpha``, default
     ``guidance_alpha``; sampled at ``temperature``, ``teacher_max_new_tokens`` tokens).
  2. Optionally keep only the traces that show the behaviour (``teacher_filter: behavior``, rejection
     sampling; with ``none`` every trace is kept, the plain off-policy distillation).
  3. Supervised finetuning of the unsteered model on (prompt, trace) pairs with TRL's ``SFTTrainer``
     (completion-only loss), then evaluation without steering.

Budget parity with VSPO: by default the teacher generates ``max_steps * per_device_train_batch_size *
gradient_accumulation_steps`` traces, as many completions as a VSPO/GRPO run of the same config samples,
and trains for the same ``max_steps`` optimizer steps (one pass over the traces when the batch sizes match).
Deviation: no task-correctness filter by default (the paper's teacher traces are not described further in the
abstract); the behaviour filter is an option because a rare behaviour may be rare under steering too.
"""

from __future__ import annotations

import random
from pathlib import Path

SFT_FIELDS = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
              "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "seed", "logging_steps",
              "report_to", "use_cpu", "bf16", "fp16", "dataloader_num_workers", "disable_tqdm", "optim")


def num_traces(cfg) -> int:
    if cfg.teacher_num_traces:
        return int(cfg.teacher_num_traces)
    return int(cfg.max_steps * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps)


def teacher_traces(model, tok, rows: list[dict], vector, cfg, behavior_kwargs: dict | None = None,
                   progress: bool = True) -> tuple[list[dict], dict]:
    """Steered samples on the training prompts: (SFT rows ``{"prompt", "completion"}``, statistics)."""
    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.rewards.behaviors import get_behavior
    from llmkit.steering import Steering

    if not rows:
        raise ValueError("teacher mode needs training prompts")
    n = num_traces(cfg)
    picked = [rows[i % len(rows)] for i in range(n)]
    alpha = cfg.teacher_alpha if cfg.teacher_alpha is not None else cfg.guidance_alpha
    params = GenerationParams(max_new_tokens=cfg.teacher_max_new_tokens or cfg.max_completion_length,
                              temperature=cfg.temperature, seed=cfg.seed)
    prompts = [chat_prompt(tok, r["prompt"]) for r in picked]
    was_training = model.training
    model.eval()
    texts: list[str] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=f"teacher traces alpha={alpha:g}", leave=False)
    try:
        bs = cfg.eval_batch_size
        for start in range(0, n, bs):
            with Steering(model, vector, float(alpha), getattr(cfg, "steering_positions", "all")):
                outs = generate(model, tok, prompts[start:start + bs], params, batch_size=bs)
            texts += [o.text for o in outs]
            if bar:
                bar.update(len(outs))
    finally:
        model.train(was_training)
        if bar:
            bar.close()
    rates = get_behavior(cfg.behavior).rates(texts, answers=[r["answer"] for r in picked],
                                             hints=[r.get("hint") for r in picked],
                                             questions=[r["question"] for r in picked], **(behavior_kwargs or {}))
    sft = [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": t}]}
           for r, t, ok in zip(picked, texts, rates) if cfg.teacher_filter == "none" or ok]
    stats = {"traces": n, "alpha": float(alpha), "behavior_rate": sum(rates) / n, "kept": len(sft)}
    if not sft:  # the filter rejected everything: distil the unfiltered traces rather than nothing
        sft = [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": t}]}
               for r, t in zip(picked, texts)]
        stats["kept"] = len(sft)
        stats["filter_fallback"] = True
    random.Random(cfg.seed).shuffle(sft)
    return sft, stats


def sft_config(cfg, output_dir: Path):
    """TRL ``SFTConfig`` with the run's optimisation settings (same steps, batch, learning rate, seed)."""
    from trl import SFTConfig

    if getattr(cfg, "llmkit_optim", None):
        raise ValueError(f"mode teacher trains with TRL's SFTTrainer and the Hugging Face optimizers; "
                         f"optim {cfg.llmkit_optim} is not wired into it: pick an HF optim (e.g. adamw_torch)")
    kw = {k: getattr(cfg, k) for k in SFT_FIELDS if hasattr(cfg, k)}
    kw["optim"] = getattr(kw.get("optim"), "value", kw.get("optim"))
    return SFTConfig(output_dir=str(output_dir), save_strategy="no", completion_only_loss=True, **kw)


def distill(model, tok, traces: list[dict], cfg, output_dir: Path, callbacks=None, peft_config=None):
    """SFT of ``model`` on ``traces``; returns the trainer after training."""
    from datasets import Dataset
    from trl import SFTTrainer

    trainer = SFTTrainer(model=model, args=sft_config(cfg, output_dir), train_dataset=Dataset.from_list(traces),
                         processing_class=tok, callbacks=callbacks or [], peft_config=peft_config)
    trainer.train()
    return trainer
