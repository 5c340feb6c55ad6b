"""``llmkit train halo``: SFT or knowledge distillation with HALO layer unfreezing (or a baseline).

Model names: any Hugging Face id or local folder, the bundled alias
(``smollm2-135m-instruct``, the default), or ``tiny-llama``: a random 2-layer
Llama with a byte-level ChatML tokenizer (``llmkit.testing``) written to
``<output_dir>/tiny-llama`` so TRL can load it by path -- for smoke tests and
CI only. As a teacher, ``tiny-llama`` is the same shape with another seed.

Outputs in ``output_dir``: ``resolved_config.yaml`` (and ``.json``),
``checkpoint-*/`` (rerunning the same command resumes from the last one;
``--resume_from_checkpoint PATH`` picks one), the final model,
``metrics.jsonl`` (every log line, with halo_t, active units, optimizer-state
MB), ``loss_curve.png``, and ``halo_results.json`` (final losses and
forgetting = completion loss on ``forget_data`` after minus before).
"""

from __future__ import annotations

import dataclasses

from trl import ModelConfig

from llmkit.train.halo.config import HaloArguments, HaloConfig

CONFIG_CLASSES = (HaloArguments, HaloConfig, ModelConfig)


def _load_data(halo_args: HaloArguments, fmt: str):
    from llmkit.train.common import chat_dataset, load_records

    train_ds = chat_dataset(load_records(halo_args.dataset_name, halo_args.dataset_train_split,
                                         halo_args.dataset_config, halo_args.max_train_samples), fmt,
                            where=halo_args.dataset_name)
    eval_ds = None
    if halo_args.eval_data:
        eval_ds = chat_dataset(load_records(halo_args.eval_data, halo_args.eval_split, halo_args.eval_data_config,
                                            halo_args.max_eval_samples), fmt, where=halo_args.eval_data)
    forget_rows = None
    if halo_args.forget_data:
        forget_rows = load_records(halo_args.forget_data, halo_args.forget_split, halo_args.forget_data_config,
                                   halo_args.max_forget_samples)
    return train_ds, eval_ds, forget_rows


def main(halo_args: HaloArguments, training_args: HaloConfig, model_args: ModelConfig) -> int:
    from trl import get_peft_config

    from llmkit.cli import UserError
    from llmkit.models import load_for_training, prepare_model_path
    from llmkit.train.common import DataError, completion_loss, wait_for_everyone
    from llmkit.train.halo.trainer import trainer_class
    from llmkit.train.skeleton import RecipeRun

    distill = bool(training_args.teacher_model_name_or_path)
    run = RecipeRun("halo", training_args, halo_args, training_args, model_args)
    out = run.out
    run.log(f"{'distillation' if distill else 'SFT'} with schedule {halo_args.halo_method}; "
            f"outputs in {out.resolve()}")

    model_path = prepare_model_path(model_args.model_name_or_path, out, seed=0, is_main=run.is_main)
    if distill:
        training_args.teacher_model_name_or_path = prepare_model_path(
            training_args.teacher_model_name_or_path, out, seed=1, is_main=run.is_main)
    wait_for_everyone()

    model, tok = load_for_training(dataclasses.replace(model_args, model_name_or_path=model_path))

    fmt = "messages" if distill else "prompt_completion"
    try:
        train_ds, eval_ds, forget_rows = _load_data(halo_args, fmt)
    except DataError as e:
        raise UserError(str(e)) from None

    kwargs = {"model": model, "args": training_args, "train_dataset": train_ds, "eval_dataset": eval_ds,
              "processing_class": tok, "peft_config": get_peft_config(model_args), "callbacks": run.callbacks(),
              "halo_callback_kwargs": halo_args.callback_kwargs(seed=training_args.seed)}
    if distill:
        kwargs["teacher_model"] = training_args.teacher_model_name_or_path
    trainer = trainer_class(distill)(**kwargs)

    def forget_loss():
        if not forget_rows:
            return None
        return completion_loss(trainer.model, tok, forget_rows, max_length=halo_args.forget_max_length,
                               batch_size=training_args.per_device_eval_batch_size)

    forget_before = forget_loss()
    result = run.train(trainer)
    trainer.save_model()
    forget_after = forget_loss()
    final_eval = trainer.evaluate() if eval_ds is not None else {}

    if run.is_main:
        summary = {
            "mode": "distillation" if distill else "sft",
            "halo_method": halo_args.halo_method,
            "model": model_path,
            "teacher": training_args.teacher_model_name_or_path if distill else None,
            "global_step": trainer.state.global_step,
            "train_loss": result.training_loss,
            "eval_loss": final_eval.get("eval_loss"),
            "forget_loss_before": forget_before,
            "forget_loss_after": forget_after,
            "forgetting": (forget_after - forget_before) if forget_rows else None,
            "peak_optimizer_state_mb": max(trainer.halo.optimizer_bytes, default=0) / 2**20,
            "train_wall_s": run.train_seconds,
        }
        path = run.write_results("halo_results.json", summary)
        png = run.plot_loss(f"{summary['mode']} / {halo_args.halo_method}")
        for k in ("train_loss", "eval_loss", "forgetting", "peak_optimizer_state_mb"):
            if summary[k] is not None:
                run.log(f"{k}: {summary[k]:.4f}")
        run.log(f"results: {path.resolve()}" + (f"; loss curve: {png.resolve()}" if png else ""))
    return 0
