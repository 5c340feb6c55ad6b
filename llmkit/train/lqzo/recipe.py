"""``llmkit train lqzo``: zeroth-order finetuning of an INT4/INT2 model (LQZO, QZO) or of the full model (MeZO).

Steps: load the model (``llmkit.models.load_for_training``: alias, folder, hub id or ``tiny-llama``);
quantize its linear layers group-wise (``quant.py``), or, when the folder holds
``lqzo_quant.safetensors`` (an earlier LQZO output), reload those codes and scales as they are;
measure held-out completion loss and the two-choice task accuracy; train with ``LQZOTrainer``; save;
measure again.

Outputs in ``output_dir``: ``resolved_config.yaml`` (and ``.json``), ``checkpoint-*/`` (rerunning the same
command resumes from the last one; ``--resume_from_checkpoint PATH`` picks one), the final model as a normal HF folder (dense dequantized weights,
what ``llmkit eval/chat/serve`` load) plus ``lqzo_quant.safetensors`` + ``lqzo_quant.json`` (the
integer codes, zero points and trained scales, to resume or continue quantized), ``metrics.jsonl``,
``loss_curve.png`` and ``lqzo_results.json`` (losses and accuracy before/after, memory held).
"""

from __future__ import annotations

import json
from pathlib import Path

from trl import ModelConfig

from llmkit.train.lqzo.config import LQZOArguments, LQZOConfig

CONFIG_CLASSES = (LQZOArguments, LQZOConfig, ModelConfig)


def prepare_quantized(model, model_path: str, settings: dict, progress: bool = True) -> str:
    """Quantize ``model`` in place per ``settings`` (or reload a saved quant state); returns what was done."""
    from safetensors.torch import load_file

    from llmkit.train.lqzo.quant import QUANT_CONFIG, QUANT_FILE, load_quant_state, quantize_model

    qfile = Path(model_path) / QUANT_FILE
    if settings["quant_bits"] and qfile.is_file():
        meta = json.loads((Path(model_path) / QUANT_CONFIG).read_text())["modules"]
        load_quant_state(model, load_file(str(qfile)), meta)
        return f"loaded quantized state from {qfile}"
    if settings["quant_bits"]:
        names = quantize_model(model, settings["quant_bits"], settings["quant_group_size"], progress=progress)
        return f"quantized {len(names)} linear layers to INT{settings['quant_bits']} (group {settings['quant_group_size']})"
    return "full precision (no quantization)"


def load_data(a: LQZOArguments, seed: int):
    from llmkit.train.common import chat_dataset, load_records
    from llmkit.train.lqzo.task import TASK_ROWS

    train = (load_records(a.dataset_name, a.dataset_train_split, a.dataset_config, a.max_train_samples)
             if a.dataset_name else [])
    if a.task_train_samples and a.accuracy_task in TASK_ROWS:
        task = [{"question": r["question"], "answer": r["answer"]}
                for r in TASK_ROWS[a.accuracy_task](a.task_train_samples, seed=10_000 + seed)]
        # interleave so every batch sees both
        mixed, i, j = [], 0, 0
        while i < len(train) or j < len(task):
            if i < len(train):
                mixed.append({"question": train[i].get("question", ""), "answer": train[i].get("answer", "")}
                             if "question" in train[i] else train[i])
                i += 1
            if j < len(task):
                mixed.append(task[j])
                j += 1
        train = mixed
    train_ds = chat_dataset(train, "prompt_completion", where=a.dataset_name)
    eval_rows = load_records(a.eval_data, a.eval_split, a.eval_data_config, a.max_eval_samples) if a.eval_data else []
    eval_ds = chat_dataset(eval_rows, "prompt_completion", where=a.eval_data) if eval_rows else None
    acc_rows = TASK_ROWS[a.accuracy_task](a.accuracy_samples, seed=20_000 + seed) if a.accuracy_task in TASK_ROWS \
        else []
    return train_ds, eval_ds, eval_rows, acc_rows


def measure(model, tok, eval_rows, acc_rows, max_length: int, batch_size: int) -> dict:
    from llmkit.train.common import completion_loss
    from llmkit.train.lqzo.task import choice_accuracy

    out = {}
    if eval_rows:
        out["eval_loss"] = completion_loss(model, tok, eval_rows, max_length=max_length, batch_size=batch_size)
    if acc_rows:
        out["accuracy"] = choice_accuracy(model, tok, acc_rows, batch_size=2 * batch_size)
    return out


def main(zo_args: LQZOArguments, training_args: LQZOConfig, model_args: ModelConfig) -> int:
    from llmkit.cli import UserError
    from llmkit.models import load_for_training
    from llmkit.train.common import DataError
    from llmkit.train.lqzo.quant import held_bytes
    from llmkit.train.lqzo.trainer import LQZOTrainer
    from llmkit.train.skeleton import RecipeRun

    settings = zo_args.resolved()
    if settings["quant_bits"] == 0 and settings["method"] != "mezo":
        raise UserError(f"zo_method {settings['method']} trains quantization scales: set quant_bits to 2 or 4 "
                        "(or use zo_method mezo for a full-precision model)")
    if getattr(model_args, "load_in_4bit", False) or getattr(model_args, "load_in_8bit", False):
        raise UserError("lqzo quantizes the model itself (quant_bits); drop load_in_4bit/load_in_8bit")
    run = RecipeRun("lqzo", training_args, zo_args, training_args, model_args)
    out, is_main = run.out, run.is_main
    run.log(f"{settings['method']}: rank {settings['rank']}, {settings['distribution']}, isotropic "
            f"{settings['isotropic']}, scales {settings['scale_mode']}, clip {settings['clip']}, "
            f"q {settings['num_directions']}; outputs in {out.resolve()}")

    model, tok = load_for_training(model_args, output_dir=out, seed=0, is_main=is_main)
    model_path = str(getattr(model, "name_or_path", "") or model_args.model_name_or_path)
    try:
        train_ds, eval_ds, eval_rows, acc_rows = load_data(zo_args, training_args.seed)
    except DataError as e:
        raise UserError(str(e)) from None
    max_len = training_args.max_length or 512
    bs = training_args.per_device_eval_batch_size
    # the before/after measurements are side work: the main process runs them, the others go on to train
    # (they wait for it at the trainer's first all-reduce) or finish
    before_fp = {}
    if (is_main and settings["quant_bits"] and eval_rows
            and not (Path(model_path) / "lqzo_quant.safetensors").is_file()):
        before_fp = measure(model, tok, eval_rows, [], max_len, bs)
    try:
        what = prepare_quantized(model, model_path, settings, progress=is_main)
    except ValueError as e:
        raise UserError(f"cannot quantize {model_path}: {e}") from None
    run.log(what)
    before = measure(model, tok, eval_rows, acc_rows, max_len, bs) if is_main else {}

    trainer = LQZOTrainer(model=model, args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
                          processing_class=tok, callbacks=run.callbacks(), zo_settings=settings)
    result = run.train(trainer)
    trainer.save_model()

    if is_main:
        after = measure(trainer.model, tok, eval_rows, acc_rows, max_len, bs)
        mem = held_bytes(trainer.model)
        # no optimizer when the checkpoint had already reached max_steps (nothing was trained in this run)
        optimizer_state = trainer.optimizer.state.values() if trainer.optimizer is not None else ()
        summary = {
            "zo": settings,
            "model": model_path,
            "world_size": training_args.world_size,
            "global_step": trainer.state.global_step,
            "forward_passes": trainer.state.global_step * 2 * settings["num_directions"]
            * training_args.gradient_accumulation_steps,
            "train_loss": result.training_loss,
            "eval_loss_full_precision": before_fp.get("eval_loss"),
            "eval_loss_before": before.get("eval_loss"),
            "eval_loss_after": after.get("eval_loss"),
            "accuracy_before": before.get("accuracy"),
            "accuracy_after": after.get("accuracy"),
            "accuracy_task": zo_args.accuracy_task,
            "trainable_elements": trainer.zo.num_elements(),
            "held_bytes": mem,
            "zo_copy_bytes": trainer.zo.backup_bytes(),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for st in optimizer_state
                                         for t in st.values() if hasattr(t, "numel")),
            "train_wall_s": run.train_seconds,
            "saved": {"hf_checkpoint": str(out.resolve()),
                      "quant_state": str((out / "lqzo_quant.safetensors").resolve()) if settings["quant_bits"] else None},
        }
        path = run.write_results("lqzo_results.json", summary)
        png = run.plot_loss(f"ZO / {settings['method']}")
        for k in ("eval_loss_full_precision", "eval_loss_before", "eval_loss_after", "accuracy_before",
                  "accuracy_after"):
            if summary[k] is not None:
                run.log(f"{k}: {summary[k]:.4f}")
        run.log(f"results: {path.resolve()}" + (f"; loss curve: {png.resolve()}" if png else ""))
    return 0

