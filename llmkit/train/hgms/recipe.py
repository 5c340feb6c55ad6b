"""``llmkit train hgms``: SFT on a mixture of data sources whose weights are learned while training.

Outputs in ``output_dir``: ``resolved_config.yaml`` (and ``.json``), ``checkpoint-*/`` (each with
``hgms_state.json``: weights, history, counters; rerunning the same command resumes from the last one with
those weights, ``--resume_from_checkpoint PATH`` picks one), the final model (or LoRA adapter),
``metrics.jsonl`` (losses, ``weight/<source>``, the method's signal), ``loss_curve.png``,
``source_weights.json`` (``{"final": {name: w}, "history": [{"step": s, "weights": {...}}]}``),
``source_weights.png`` and ``hgms_results.json`` (losses on the target and held-out sets after
training, examples per source, extra passes and seconds spent on weighting). With ``weighting: doremi``
and no ``doremi_reference_model``, ``doremi_reference/`` holds the reference model DoReMi trains first
on the uniform mixture (its steps are part of DoReMi's cost: ``reference_steps`` in the results); a
resumed run reuses it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from trl import ModelConfig

from llmkit.train.hgms.config import HgmsArguments, HgmsConfig

CONFIG_CLASSES = (HgmsArguments, HgmsConfig, ModelConfig)


def build_mixture(args: HgmsArguments):
    """(concatenated prompt/completion Dataset with source_id, sizes, target Dataset, target rows, held-out rows)."""
    from datasets import concatenate_datasets

    from llmkit.train.common import chat_dataset, load_records
    from llmkit.train.hgms.mixtures import load_sources

    parts, sizes = [], []
    for i, (src, rows) in enumerate(zip(args.parsed_sources, load_sources(args.parsed_sources,
                                                                          args.max_samples_per_source))):
        ds = chat_dataset(rows, "prompt_completion", where=f"source {src.name!r} ({src.path})")
        parts.append(ds.add_column("source_id", [i] * len(ds)))
        sizes.append(len(ds))
    target_rows, target_ds = None, None
    if args.target_data:
        target_rows = load_records(args.target_data, args.target_split, args.target_data_config,
                                   args.max_target_samples)
        target_ds = chat_dataset(target_rows, "prompt_completion", where=f"target_data ({args.target_data})")
    heldout_rows = None
    if args.heldout_data:
        heldout_rows = load_records(args.heldout_data, args.heldout_split, None, args.max_heldout_samples)
    return concatenate_datasets(parts), sizes, target_ds, target_rows, heldout_rows


REFERENCE_DIR = "doremi_reference"


def _train_reference(hgms_args: HgmsArguments, training_args: HgmsConfig, model_args: ModelConfig, out: Path,
                     is_main: bool):
    """DoReMi's step 1: train the same starting model on the uniform mixture, save it (before anything
    could merge an adapter into it), and return it frozen."""
    ref_hg = copy.deepcopy(hgms_args)
    ref_hg.weighting = "uniform"
    ref_ta = copy.deepcopy(training_args)
    ref_ta.output_dir = str(out / REFERENCE_DIR)
    ref_ta.save_strategy = "no"
    ref_ta.eval_strategy = "no"
    ref_ta.resume_from_checkpoint = None
    if hgms_args.doremi_reference_steps:
        ref_ta.max_steps = hgms_args.doremi_reference_steps
    if is_main:
        print(f"[hgms] doremi: training the reference model on the uniform mixture for {ref_ta.max_steps} "
              f"steps first ({ref_ta.output_dir})", flush=True)
    trainer, *_ = make_trainer(ref_hg, ref_ta, model_args, out=out, is_main=is_main)
    trainer.train()
    trainer.save_model(ref_ta.output_dir)
    ref = trainer.accelerator.unwrap_model(trainer.model)
    del trainer
    return ref


def _saved_reference(out: Path) -> Path | None:
    """The reference an earlier invocation of this run trained and saved (a full model or a LoRA adapter)."""
    folder = out / REFERENCE_DIR
    full = (folder / "config.json").is_file() and any(
        (folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    adapter = (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    return folder if full or adapter else None


def _reference_model(args: HgmsArguments, training_args: HgmsConfig, model_args: ModelConfig, out: Path,
                     is_main: bool, resume: str | None = None):
    if args.weighting != "doremi":
        return None
    # a resumed run keeps the reference its first invocation trained (training it again costs its steps again)
    path = args.doremi_reference_model or (_saved_reference(out) if resume else None)
    if path:
        from llmkit.models import load_for_training

        if is_main and not args.doremi_reference_model:
            print(f"[hgms] doremi: resuming with the reference model saved in {path}", flush=True)
        ref_args = copy.deepcopy(model_args)
        ref_args.model_name_or_path = str(path)
        ref_args.use_peft = False
        ref, _ = load_for_training(ref_args, output_dir=out, seed=0, is_main=is_main)
    else:
        ref = _train_reference(args, training_args, model_args, out, is_main)
    ref.eval().requires_grad_(False)
    return ref


def make_trainer(hgms_args: HgmsArguments, training_args: HgmsConfig, model_args: ModelConfig, *, out: Path,
                 is_main: bool = True, callbacks=(), resume: str | None = None):
    """Load the model, the sources and the target, and build the trainer (used by the recipe and the bench).
    ``resume``: the checkpoint the run resumes from (then DoReMi reuses the reference saved in ``out``)."""
    from trl import get_peft_config

    from llmkit.cli import UserError
    from llmkit.models import load_for_training
    from llmkit.train.common import DataError
    from llmkit.train.hgms.trainer import HgmsSFTTrainer, WeightController

    if not hgms_args.parsed_sources:
        raise UserError("hgms: the config names no sources (sources: [{name, path}, ...])")
    if not hgms_args.target_data and hgms_args.weighting in ("hgms", "doge"):
        raise UserError(f"hgms: weighting {hgms_args.weighting} needs target_data (the outer objective)")
    if training_args.packing:
        raise UserError("hgms: packing mixes sources inside a sequence; set packing: false")
    training_args.shuffle_dataset = False  # the sampler needs rows in source order
    try:
        train_ds, sizes, target_ds, target_rows, heldout_rows = build_mixture(hgms_args)
    except (DataError, ValueError) as e:
        raise UserError(str(e)) from None
    reference = _reference_model(hgms_args, training_args, model_args, out, is_main, resume)
    model, tok = load_for_training(model_args, output_dir=out, seed=0, is_main=is_main)
    names = [s.name for s in hgms_args.parsed_sources]
    controller = WeightController(names, hgms_args.weighting, initial=hgms_args.initial_weights,
                                  lr=hgms_args.weights_lr, smoothing=hgms_args.weights_smoothing,
                                  normalize=hgms_args.weights_normalize, interval=hgms_args.weights_update_interval,
                                  odm_decay=hgms_args.odm_decay)
    trainer = HgmsSFTTrainer(model=model, args=training_args, train_dataset=train_ds,
                  eval_dataset={"target": target_ds} if target_ds is not None else None,
                  processing_class=tok, peft_config=get_peft_config(model_args), callbacks=list(callbacks),
                  controller=controller, source_sizes=sizes, probe_batch_size=hgms_args.probe_batch_size,
                  param_last_layers=hgms_args.hgms_last_layers, param_regex=hgms_args.hgms_param_regex,
                  lanczos_iters=hgms_args.hgms_lanczos_iters, rtol=hgms_args.hgms_rtol,
                  select_lr=hgms_args.hgms_select_lr, select_probes=hgms_args.hgms_select_probes,
                  reference_model=reference, min_trust=hgms_args.hgms_min_trust,
                  trust={"max_grad_ratio": hgms_args.hgms_max_grad_ratio,
                         "max_negative_curvature": hgms_args.hgms_max_negative_curvature,
                         "max_solve_residual": hgms_args.hgms_max_solve_residual,
                         "max_newton_gap": hgms_args.hgms_max_newton_gap} if hgms_args.hgms_trust else None)
    return trainer, tok, target_rows, heldout_rows


def main(hgms_args: HgmsArguments, training_args: HgmsConfig, model_args: ModelConfig) -> int:
    from llmkit.train.common import completion_loss
    from llmkit.train.hgms.trainer import STATE_FILE
    from llmkit.train.skeleton import RecipeRun

    run = RecipeRun("hgms", training_args, hgms_args, training_args, model_args)
    out = run.out
    run.log(f"weighting {hgms_args.weighting} over sources "
            f"{', '.join(s.name for s in hgms_args.parsed_sources)}; outputs in {out.resolve()}")
    trainer, tok, target_rows, heldout_rows = make_trainer(hgms_args, training_args, model_args, out=out,
                                                           is_main=run.is_main, callbacks=run.callbacks(),
                                                           resume=run.resume)
    if run.resume and (Path(run.resume) / STATE_FILE).is_file():  # the weights the checkpoint was trained with
        trainer.hgms.load(json.loads((Path(run.resume) / STATE_FILE).read_text()))
    result = run.train(trainer)
    trainer.save_model()

    def loss_on(rows):
        if not rows:
            return None
        return completion_loss(trainer.model, tok, rows, max_length=training_args.max_length or 512,
                               batch_size=training_args.per_device_eval_batch_size)

    target_loss, heldout_loss = loss_on(target_rows), loss_on(heldout_rows)
    if run.is_main:
        c = trainer.hgms
        wpath = c.save_weights(out / "source_weights.json")
        png = c.plot(out / "source_weights.png")
        summary = {
            "weighting": hgms_args.weighting,
            "sources": [s.path for s in hgms_args.parsed_sources],
            "global_step": trainer.state.global_step,
            "train_loss": result.training_loss,
            "target_loss": target_loss,
            "heldout_loss": heldout_loss,
            "final_weights": c.weights_dict(),
            "source_examples": dict(zip(c.names, c.source_examples)),
            "train_tokens": int(getattr(trainer, "_total_train_tokens", 0)),
            "weight_updates": c.updates,
            "weight_refusals": c.refused,
            "extra_passes": c.passes,
            "selection_examples": c.select_examples,
            "reference_steps": (hgms_args.doremi_reference_steps or training_args.max_steps)
            if hgms_args.weighting == "doremi" and not hgms_args.doremi_reference_model else 0,
            "weighting_seconds": c.update_seconds,
            "train_wall_s": run.train_seconds,
        }
        run.write_results("hgms_results.json", summary)
        run.plot_loss(f"hgms / {hgms_args.weighting}")
        run.log("final weights: " + ", ".join(f"{n}={w:.3f}" for n, w in c.weights_dict().items()))
        for k in ("train_loss", "target_loss", "heldout_loss"):
            if summary[k] is not None:
                run.log(f"{k}: {summary[k]:.4f}")
        run.log(f"weights: {wpath.resolve()}; plot: {png.resolve()}")
    return 0
