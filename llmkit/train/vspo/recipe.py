"""``llmkit train vspo``: VSPO (steering-vector GRPO) and its baselines on GSM8K-style data.

Modes: ``vspo`` (steered rollouts, loss on the unsteered policy), ``grpo`` (reward-shaped GRPO: the same
rewards, alpha = 0), ``guidance`` (no training; the base model steered at ``guidance_alpha`` at inference) and
``teacher`` (teacher-trace distillation: SFT on the steered model's own samples, evaluated unsteered;
``teacher.py``). With ``curve_every_steps N`` a trained mode also evaluates (greedy, unsteered) every N steps on
``curve_num_problems`` problems and reports ``first_step_at_target``: the first step whose behaviour rate
reaches ``target_behavior_rate`` (null: not reached by ``max_steps``; guidance: 0 or null).

Model names: a Hugging Face id or local folder, the bundled alias (default), or ``tiny-llama`` (a random
2-layer Llama with a byte-level ChatML tokenizer written to ``<output_dir>/tiny-llama``; smoke tests only).

Outputs in ``output_dir``: ``resolved_config.yaml`` (and ``.json``); ``steering/`` (the vector used, extracted from the
behaviour's contrastive pairs unless ``steering_vector`` names one); ``checkpoint-*/`` (a rerun of the same
command resumes from the last one; ``--resume_from_checkpoint PATH`` picks one); the final model;
``metrics.jsonl``; ``reward_curves.png``; ``eval.json`` (behaviour rate and task accuracy before/after;
``rollouts_per_step``: per optimizer step, the rollouts' mean behaviour reward, steered and unsteered total
rewards; with ``aligned_alpha_range``, ``steered_share_above_base``: the share of the run's rollouts that the
schedule samples inside that range, i.e. where the alignment check saw the behaviour above its unsteered rate).

Long CPU runs in pieces: ``--stop_after_minutes M`` saves a checkpoint and stops after the first step that ends
past M minutes (counted from the start of the command, the "before" evaluation included); the same command run
again resumes there, keeping the "before" evaluation already written to ``eval.json``. The final evaluation runs
only in the invocation that reaches ``max_steps``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from trl import ModelConfig

from llmkit.train.vspo.config import VSPOConfig

CONFIG_CLASSES = (VSPOConfig, ModelConfig)
CURVE_KEYS = ("reward", "vspo/reward_steered", "vspo/reward_unsteered", "vspo/alpha_max")


def behavior_kwargs(cfg: VSPOConfig) -> dict:
    if cfg.behavior == "verbosity":
        return {"min_words": cfg.verbosity_min_words, "max_words": cfg.verbosity_max_words}
    if cfg.behavior == "concise_answer":
        return {"max_words": cfg.verbosity_max_words}
    return {}


def reward_functions(cfg: VSPOConfig) -> tuple[list, list[float]]:
    from llmkit.rewards import gsm8k_correctness, math_correctness
    from llmkit.rewards.behaviors import get_behavior

    funcs, weights = [], []
    if cfg.task_reward != "none":
        task = {"gsm8k": gsm8k_correctness, "math": math_correctness}.get(cfg.task_reward)
        if task is None:
            raise ValueError(f"task_reward must be gsm8k, math or none, got '{cfg.task_reward}'")
        if cfg.behavior == "confidence":
            task = _graded_without_confidence(task)
        funcs.append(task)
        weights.append(cfg.task_weight)
    funcs.append(get_behavior(cfg.behavior).reward(**behavior_kwargs(cfg)))
    weights.append(cfg.behavior_weight)
    return funcs, weights


def _graded_without_confidence(task):
    """The task reward applied after cutting "Confidence: 80%"-style statements (they would be read as the answer)."""
    from llmkit.rewards.behaviors import completion_text, strip_confidence

    def wrapped(completions=None, **kw):
        return task(completions=[strip_confidence(completion_text(c)) for c in completions], **kw)

    wrapped.__name__ = task.__name__
    return wrapped


def steering_vector_for(cfg: VSPOConfig, model, tok, train_rows: list[dict], out: Path):
    """Load ``cfg.steering_vector``, or reuse/extract ``out/steering`` from the behaviour's contrastive pairs."""
    from llmkit.rewards.behaviors import contrastive_pairs
    from llmkit.steering import SteeringVector, check_compatible, extract

    if cfg.steering_vector:
        vec = SteeringVector.load(cfg.steering_vector)
    elif (out / "steering" / "steering.safetensors").is_file():  # resumed run: same vector as before
        vec = SteeringVector.load(out / "steering")
    else:
        # questions from the end of the training rows, so the pairs and the first training prompts differ
        questions = [r["question"] for r in train_rows[::-1][:cfg.steering_num_pairs]]
        vec = extract(model, tok, contrastive_pairs(cfg.behavior, questions), layers=cfg.steering_layers,
                      behavior=cfg.behavior)
        vec.save(out / "steering")
    check_compatible(model, vec)
    return vec


def rollouts_per_step(metrics: Path, behavior: str) -> list[dict]:
    """Per logged training step: the rollouts' mean behaviour reward and the steered / unsteered mean rewards."""
    keys = {f"rewards/{behavior}/mean": "behavior_reward", "vspo/reward_steered": "reward_steered",
            "vspo/reward_unsteered": "reward_unsteered", "vspo/share_above_base": "share_above_base",
            "vspo/alpha_max": "alpha_max"}
    rows = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            row = {new: rec[old] for old, new in keys.items() if isinstance(rec.get(old), (int, float))}
            if row and "step" in rec:
                rows.append({"step": rec["step"], **row})
    return rows


def time_budget_callback(minutes: float, started: float):
    """Stop (with a checkpoint) after the first training step that ends more than ``minutes`` after ``started``."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if time.time() - started >= minutes * 60 and state.global_step < state.max_steps:
                control.should_save = True
                control.should_training_stop = True
            return control

    return StopAfter()


def curve_callback(evaluate_fn, every: int, sink: list, path: Path):
    """Every ``every`` optimizer steps (and at the last) append ``evaluate_fn(model)`` with its step to ``sink``
    and to the JSONL file ``path``."""
    from transformers import TrainerCallback

    class Curve(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if model is None or not (state.global_step % every == 0 or state.global_step == state.max_steps):
                return control
            point = {"step": state.global_step, **evaluate_fn(model)}
            sink.append(point)
            with path.open("a") as f:
                f.write(json.dumps(point) + "\n")
            return control

    return Curve()


def first_step_at(curve: list[dict], target: float) -> int | None:
    """The first curve step whose behaviour rate is >= ``target``; None when no point reaches it."""
    return next((p["step"] for p in sorted(curve, key=lambda p: p["step"]) if p["behavior_rate"] >= target), None)


def main(cfg: VSPOConfig, model_args: ModelConfig | None = None) -> int:
    from datasets import Dataset
    from trl import get_peft_config

    from llmkit.models import load_for_training, prepare_model_path
    from llmkit.train.common import wait_for_everyone
    from llmkit.train.skeleton import RecipeRun
    from llmkit.train.vspo.data import build_rows, load_records
    from llmkit.train.vspo.evaluate import evaluate
    from llmkit.train.vspo.trainer import VSPOTrainer

    started = time.time()
    model_args = model_args or ModelConfig()
    # under `accelerate launch` every rank trains; side work (config, steering extraction, evaluations,
    # plots, eval.json) happens on the main process only and the others wait for what it writes
    run = RecipeRun("vspo", cfg, cfg, model_args)
    out, is_main, resume = run.out, run.is_main, run.resume
    if run.config_path:
        print(f"saved {run.config_path}")
    path = prepare_model_path(model_args.model_name_or_path, out, cfg.tiny_model_seed, is_main=is_main)
    wait_for_everyone()
    model, tok = load_for_training(dataclasses.replace(model_args, model_name_or_path=path))

    task_name = "math500" if cfg.task_reward == "math" else "gsm8k"
    train_rows = build_rows(load_records(cfg.dataset_name, cfg.dataset_limit, cfg.dataset_train_split, task_name,
                                         cfg.dataset_config), cfg.behavior,
                            cfg.hint_seed, task_name)
    eval_rows = []
    if cfg.eval_path and cfg.eval_num_problems > 0:
        eval_rows = build_rows(load_records(cfg.eval_path, cfg.eval_num_problems, "test", task_name), cfg.behavior,
                               cfg.hint_seed + 1, task_name)
    need_vector = cfg.mode in ("guidance", "teacher") or (cfg.mode == "vspo" and cfg.alpha_max > 0)
    vector = None
    if need_vector and is_main:
        vector = steering_vector_for(cfg, model, tok, train_rows, out)
    wait_for_everyone()
    if need_vector and not is_main:  # the vector the main process extracted and saved (or the given one)
        vector = steering_vector_for(cfg, model, tok, train_rows, out)
    bkw = behavior_kwargs(cfg)

    def run_eval(alpha: float = 0.0, what: str = "") -> dict | None:
        if not eval_rows or not is_main:
            return None
        t0 = time.time()
        r = evaluate(model, tok, eval_rows, cfg.behavior, max_new_tokens=cfg.eval_max_new_tokens,
                     batch_size=cfg.eval_batch_size, vector=vector, alpha=alpha, behavior_kwargs=bkw,
                     task_name=task_name, positions=cfg.steering_positions)
        print(f"eval {what}: accuracy {r['accuracy']:.3f}, {cfg.behavior} rate {r['behavior_rate']:.3f}, "
              f"mean words {r['mean_words']:.1f} (n={r['n']}, {time.time() - t0:.0f}s)")
        return r

    results: dict = {"mode": cfg.mode, "behavior": cfg.behavior, "model": str(model_args.model_name_or_path)}
    eval_json = out / "eval.json"
    if resume and eval_json.is_file():  # an earlier piece of this run wrote the evaluation before training
        earlier = json.loads(eval_json.read_text())
        if earlier.get("before"):
            results["before"] = earlier["before"]
        results["train_seconds"] = earlier.get("train_seconds", 0.0)
    if cfg.eval_before and not resume and is_main:
        results["before"] = run_eval(0.0, "before")
        run.write_results(eval_json.name, results)

    curve: list[dict] = []
    callbacks = run.callbacks()
    if cfg.stop_after_minutes is not None:
        callbacks.append(time_budget_callback(cfg.stop_after_minutes, started))
    if cfg.curve_every_steps and eval_rows and is_main and cfg.mode != "guidance":
        curve_rows = eval_rows[:cfg.curve_num_problems]

        def curve_eval(m):
            r = evaluate(m, tok, curve_rows, cfg.behavior, max_new_tokens=cfg.eval_max_new_tokens,
                         batch_size=cfg.eval_batch_size, behavior_kwargs=bkw, task_name=task_name, progress=False)
            return {k: r[k] for k in ("n", "behavior_rate", "accuracy", "mean_words")}

        if (out / "curve.jsonl").is_file() and resume:
            curve += [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines() if line.strip()]
        elif (out / "curve.jsonl").is_file():
            (out / "curve.jsonl").unlink()
        callbacks.append(curve_callback(curve_eval, cfg.curve_every_steps, curve, out / "curve.jsonl"))

    if cfg.mode == "guidance":
        results["after"] = run_eval(cfg.guidance_alpha, f"guidance alpha={cfg.guidance_alpha:g}")
        if results["after"] is not None:
            results["target_behavior_rate"] = cfg.target_behavior_rate
            results["first_step_at_target"] = 0 if results["after"]["behavior_rate"] >= cfg.target_behavior_rate \
                else None
    elif cfg.mode == "teacher":
        from llmkit.train.vspo.teacher import distill, teacher_traces

        if resume:
            raise ValueError("mode teacher does not resume from checkpoints: rerun it with a fresh output_dir")
        t0 = time.time()
        traces, stats = teacher_traces(model, tok, train_rows, vector, cfg, bkw)
        print(f"teacher traces: {stats['traces']} at alpha {stats['alpha']:g}, {cfg.behavior} rate "
              f"{stats['behavior_rate']:.3f}, {stats['kept']} kept for SFT")
        results["teacher"] = stats
        trainer = distill(model, tok, traces, cfg, out, callbacks, get_peft_config(model_args))
        results["train_seconds"] = round(time.time() - t0, 1)
        results["steps"] = trainer.state.global_step
        trainer.save_model(str(out))
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not is_main:
            return 0
        results["after"] = run_eval(0.0, "after teacher distillation (unsteered)")
    else:
        funcs, weights = reward_functions(cfg)
        cfg.reward_weights = weights
        trainer = VSPOTrainer(
            model=model, args=cfg, reward_funcs=funcs, train_dataset=Dataset.from_list(train_rows),
            processing_class=tok, peft_config=get_peft_config(model_args), steering_vector=vector,
            callbacks=callbacks,
        )
        run.train(trainer)
        results["train_seconds"] = round(results.get("train_seconds", 0.0) + run.train_seconds, 1)  # all pieces
        results["steps"] = trainer.state.global_step
        if trainer.state.global_step < trainer.state.max_steps:
            results["stopped_early"] = True
            if is_main:
                run.write_results(eval_json.name, results)
            print(f"stopped after step {trainer.state.global_step}/{trainer.state.max_steps} "
                  f"(stop_after_minutes={cfg.stop_after_minutes:g}); rerun the same command to resume")
            return 0
        trainer.save_model(str(out))
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not is_main:
            return 0
        results["after"] = run_eval(0.0, "after (unsteered)")
        results["rollouts_per_step"] = rollouts_per_step(out / "metrics.jsonl", cfg.behavior)
        if cfg.aligned_alpha_range:
            from llmkit.train.vspo.trainer import scheduled_share_in_range

            lo, hi = cfg.aligned_alpha_range
            results["aligned_alpha_range"] = [lo, hi]
            results["steered_share_above_base"] = scheduled_share_in_range(
                cfg, trainer.state.max_steps, cfg.num_generations, lo, hi)
        png = run.plot_rewards(f"{cfg.mode} / {cfg.behavior}", CURVE_KEYS, ylabel="reward / alpha")
        if png:
            print(f"reward curves: {png}")
    if not is_main:
        return 0
    if curve:
        results["curve"] = curve
        results["target_behavior_rate"] = cfg.target_behavior_rate
        results["first_step_at_target"] = first_step_at(curve, cfg.target_behavior_rate)
    print(f"results: {run.write_results(eval_json.name, results)}")
    return 0
