"""VSPO's experiments: the method against the paper's baselines, the bandit abstraction, and step time.

Paper: "Vector-Steered Policy Optimization" (VSPO), NeurIPS 2026. Results: bench/results/vspo.md,
vspo_bandit.md, vspo_timing.md.

Methods comparison (``bench/vspo.py``). 1. The alignment check (the paper's condition "steering-induced
distributions sufficiently aligned with the target behavior", :mod:`llmkit.train.vspo.alignment`): extract the
behaviour's vector, sample the base model at the rollout temperature on held-out problems unsteered and at each
candidate (positions, intensity), pick one (:func:`alignment_check`). The pick sets the runs' positions,
``guidance_alpha``, ``alpha_max`` and ``aligned_alpha_range`` (:func:`apply_pick`). 2. Every arm runs through
``llmkit train vspo`` with one config (:data:`RUN_MODES`; guidance trains nothing and runs once), resumable and
splittable over processes (:func:`collect_runs`). 3. Per arm the seeds' graded problems are pooled into one
proportion with a Wilson interval; a seed that never reached the target behaviour rate is right-censored at
``max_steps`` (Kaplan-Meier median, :func:`first_steps`); :func:`method_figures` names the figures.

Bandit abstraction (``bench/vspo_bandit.py``). The policy is ``softmax(theta)`` over K arms; a few correct arms
also show the behaviour; the shaped reward is correct + behaviour and the target is the correct behaviour arms,
initial mass ``p0``. One iteration is one GRPO step over ``groups`` groups of G arms (group-normalised
advantages, ``e_a - pi`` gradients). Reward shaping draws every arm from pi; VSPO draws the g-th arm of a group
from ``pi * exp(alpha_g s)`` with ``alpha_g`` spread over [0, alpha_top] and keeps the unsteered gradient (no
importance weights, as ``VSPOTrainer``); ``s`` is the behaviour indicator (aligned) or as many arms without it
(misaligned); ``alpha_top`` anneals linearly to 0 or stays fixed. A run that misses the target by ``max_iters``
is censored: reported as not reached, Kaplan-Meier medians (``scipy.stats.ecdf``), speedups as ratios of
medians or lower bounds (:func:`speedup`), never the cap counted as a hitting time.

Step time (``bench/vspo.py --timing``): median optimizer-step seconds of VSPO and TRL's ``GRPOTrainer`` on the
same rows and rewards, rounds interleaved (:func:`step_timing`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmkit.experiments.stats import wilson

METHODS = ("vspo", "vspo_fixed", "grpo", "teacher", "guidance")
RUN_MODES = {"vspo": {"mode": "vspo"}, "vspo_fixed": {"mode": "vspo", "alpha_anneal": "none"},
             "grpo": {"mode": "grpo"}, "teacher": {"mode": "teacher"}}
BANDIT_METHODS = ("reward_shaping", "vspo_aligned", "vspo_aligned_fixed", "vspo_misaligned", "vspo_misaligned_fixed")


def write_results(results: Path, name: str, payload: dict) -> Path:
    """``results/<name>.json`` (indent 2, as the committed results are written); returns the path."""
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{name}.json"
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def print_figures(fig: dict) -> None:
    """One line per figure, floats to three decimals."""
    for k, v in fig.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")


# --- statistics over seeds ------------------------------------------------------------------------------------

def km_median(times: list[int | None], cap: int) -> float | None:
    """Kaplan-Meier median hitting time; ``None`` in ``times`` is a run censored at ``cap``. Returns None when the
    survival curve never falls to 0.5 (the median is not reached by the cap)."""
    from scipy.stats import CensoredData, ecdf

    done = [float(t) for t in times if t is not None]
    cens = [float(cap) for t in times if t is None]
    if not done:
        return None
    sf = ecdf(CensoredData(uncensored=done, right=cens)).sf
    below = np.flatnonzero(sf.probabilities <= 0.5)
    return float(sf.quantiles[below[0]]) if below.size else None


def pooled(evals: list[dict], key: str) -> dict:
    """``key`` (behavior_rate or accuracy) pooled over the seeds' evaluations: rate, Wilson CI, per-seed values."""
    if not evals:
        raise ValueError("no evaluations to pool")
    per_seed = [float(e[key]) for e in evals]
    k = sum(round(float(e[key]) * e["n"]) for e in evals)
    n = sum(int(e["n"]) for e in evals)
    lo, hi = wilson(k, n)
    return {"rate": k / n, "ci95": [lo, hi], "k": k, "n": n, "per_seed": per_seed,
            "seed_sd": statistics.stdev(per_seed) if len(per_seed) > 1 else None}


def first_steps(runs: list[dict], max_steps: int) -> dict:
    """First step at the target behaviour rate over seeds: values (None = censored at max_steps), reached count and
    the Kaplan-Meier median (None when fewer than half the seeds reached it)."""
    steps = [r.get("first_step_at_target") for r in runs]
    done = [s for s in steps if s is not None]
    return {"per_seed": steps, "reached": len(done), "runs": len(steps), "km_median": km_median(steps, max_steps),
            "mean_reached": statistics.mean(done) if done else None, "cap": max_steps}


def summarize_methods(runs_by_method: dict[str, list[dict]], max_steps: int) -> dict:
    """``{method: {"behavior_rate": pooled, "accuracy": pooled, "first_step": first_steps, "seeds": n}}`` from the
    runs' ``eval.json``; a method without an ``after`` evaluation is left out."""
    out = {}
    for method, runs in runs_by_method.items():
        evals = [r["after"] for r in runs if r.get("after")]
        if not evals:
            continue
        out[method] = {"behavior_rate": pooled(evals, "behavior_rate"), "accuracy": pooled(evals, "accuracy"),
                       "mean_words": statistics.mean(e["mean_words"] for e in evals), "seeds": len(evals),
                       "first_step": first_steps(runs, max_steps)}
    return out


# --- methods comparison ---------------------------------------------------------------------------------------

def run_config(*, model: str, behavior: str, max_words: int, train_path: str, test_path: str, eval_n: int,
               tokens: int, steps: int, batch_size: int, learning_rate: float, quick: bool, curve_every: int,
               curve_n: int, target: float, layer: int | None = None, temperature: float = 0.7) -> dict:
    """The ``llmkit train vspo`` overrides every arm shares (CPU, no saving, one curve point every
    ``curve_every`` steps on ``curve_n`` problems, rollouts sampled at ``temperature``)."""
    common = {
        "model_name_or_path": model, "behavior": behavior, "verbosity_max_words": max_words,
        "dataset_name": train_path, "dataset_limit": 512, "eval_path": test_path, "eval_num_problems": eval_n,
        "eval_max_new_tokens": tokens, "eval_batch_size": 16, "steering_num_pairs": 16 if quick else 32,
        "alpha_anneal": "linear", "alpha_anneal_fraction": 0.75, "max_steps": steps,
        "per_device_train_batch_size": batch_size, "num_generations": 4, "max_completion_length": tokens,
        "temperature": temperature, "learning_rate": learning_rate, "lr_scheduler_type": "constant", "beta": 0.0,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True, "bf16": False,
        "dataloader_num_workers": 0, "disable_tqdm": True, "curve_every_steps": curve_every,
        "curve_num_problems": curve_n, "target_behavior_rate": target,
    }
    if layer is not None:
        common["steering_layers"] = [layer]
    return common


def parse_candidates(spec: str) -> list[tuple[str, list[float]]]:
    """``"all:1,1.5;answer:2,4"`` -> ``[("all", [1.0, 1.5]), ("answer", [2.0, 4.0])]``; ValueError naming the bad
    candidate."""
    out = []
    for part in spec.split(";"):
        pos, _, al = part.partition(":")
        try:
            alphas = [float(a) for a in al.split(",")]
        except ValueError:
            raise ValueError(f"--align: bad candidate {part!r} (expected positions:alpha,alpha,...)") from None
        if pos not in ("all", "answer"):
            raise ValueError(f"--align: positions must be all or answer, got {pos!r} in {part!r}")
        out.append((pos, alphas))
    return out


def alignment_check(common: dict, work: Path, *, candidates: str, align_n: int, max_words: int, threads: int = 1,
                    reuse: bool = False) -> dict:
    """The alignment condition on ``align_n`` held-out test problems (after the evaluation problems): extract the
    vector from the behaviour's contrastive pairs as the recipe does, save it to ``work/steering``, measure every
    candidate at the rollout temperature (seeded), pick one. Cached in ``work/alignment.json`` (``reuse``)."""
    from llmkit.train.vspo.alignment import format_table

    vec_dir, cached = work / "steering", work / "alignment.json"
    temperature = float(common["temperature"])
    if reuse and cached.is_file() and (vec_dir / "steering.safetensors").is_file() \
            and json.loads(cached.read_text()).get("temperature") == temperature:
        result = json.loads(cached.read_text())
        for line in format_table(result["table"]):
            print(line)
        return result
    import torch

    from llmkit.models import load
    from llmkit.rewards.behaviors import contrastive_pairs
    from llmkit.steering import SteeringVector, extract
    from llmkit.train.vspo.alignment import measure, pick
    from llmkit.train.vspo.data import build_rows, load_records

    behavior, tokens = common["behavior"], common["eval_max_new_tokens"]
    torch.set_num_threads(threads)
    model, tok = load(common["model_name_or_path"])
    train = build_rows(load_records(common["dataset_name"], common["dataset_limit"], "train"), behavior)
    start = common["eval_num_problems"]  # held out from the evaluation problems as well
    test = build_rows(load_records(common["eval_path"], start + align_n, "test"), behavior, 1)[start:]
    questions = [r["question"] for r in train[::-1][:common["steering_num_pairs"]]]  # as the recipe extracts it
    vec = extract(model, tok, contrastive_pairs(behavior, questions), layers=common.get("steering_layers"),
                  behavior=behavior)
    vec.save(vec_dir)
    layer = "+".join(map(str, vec.layers))
    cands = {f"layer{layer}-{pos}": (vec, pos, alphas) for pos, alphas in parse_candidates(candidates)}
    table = measure(model, tok, test, cands, [], behavior, behavior_kwargs={"max_words": max_words},
                    max_new_tokens=tokens, batch_size=common["eval_batch_size"], progress=True,
                    temperature=temperature, seed=0)
    choice = pick(table)
    for line in format_table(table):
        print(line)
    result = {"table": table, "pick": choice, "n": len(test), "norms": SteeringVector.load(vec_dir).norms(),
              "max_new_tokens": tokens, "candidates": candidates, "temperature": temperature}
    cached.write_text(json.dumps(result, indent=2) + "\n")
    return result


def apply_pick(common: dict, choice: dict, steering_dir: Path, *, guidance_alpha: float | None = None,
               alpha_max: float | None = None, spread: str = "aligned", aligned_share: float = 1 / 3) -> dict:
    """Set the runs' steering from the alignment pick (explicit values win): ``guidance_alpha`` (the pick's alpha,
    else 1), ``alpha_max`` (top of the pick's range, else guidance_alpha), positions, the vector and, when the
    check found a range, ``aligned_alpha_range``; ``spread aligned`` without a range falls back to linspace.
    Updates and returns ``common``."""
    ga = guidance_alpha if guidance_alpha is not None else (choice["alpha"] or 1.0)
    am = alpha_max if alpha_max is not None else (choice["range"][1] if choice.get("range") else ga)
    common.update({"guidance_alpha": ga, "alpha_max": am, "steering_positions": choice.get("positions") or "all",
                   "steering_vector": str(steering_dir)})
    if choice.get("range"):
        common["aligned_alpha_range"] = list(choice["range"])
    elif spread == "aligned":
        print("the alignment check found no intensity range above the unsteered rate: VSPO spreads by linspace")
        spread = "linspace"
    common.update({"alpha_spread": spread, "aligned_share": aligned_share})
    return common


def plan(common: dict, seeds: int) -> list[tuple[str, str, dict]]:
    """``(method, folder name, overrides)`` per run: guidance once (seed-free, greedy), then every trained arm per
    seed."""
    out = [("guidance", "guidance", {**common, "eval_before": True, "mode": "guidance"})]
    for seed in range(seeds):
        for m, mode in RUN_MODES.items():
            out.append((m, f"{m}-{seed}", {**common, "eval_before": False, **mode, "seed": seed}))
    return out


def finished(out: Path, overrides: dict) -> dict | None:
    """A finished run's eval.json when ``out`` holds one made with exactly ``overrides``, else None."""
    done, made = out / "eval.json", out / "bench_overrides.json"
    if done.is_file() and made.is_file() and json.loads(made.read_text()) == overrides:
        ev = json.loads(done.read_text())
        return ev if ev.get("after") else None
    return None


def run_recipe(out: Path, overrides: dict, reuse: bool = False) -> dict:
    """One ``llmkit train vspo`` run in this process; returns its eval.json (``reuse``: a finished run with the
    same overrides is returned as is)."""
    from llmkit.commands.train import parse_method_args

    if reuse and (ev := finished(out, overrides)) is not None:
        return ev
    if out.exists():
        import shutil

        shutil.rmtree(out)
    argv = []
    for k, v in overrides.items():
        argv += [f"--{k}", *map(str, v)] if isinstance(v, list) else [f"--{k}", str(v)]
    module, configs = parse_method_args("vspo", argv + ["--output_dir", str(out)])
    if module.main(*configs) != 0:
        raise RuntimeError(f"run failed: {out}")
    (out / "bench_overrides.json").write_text(json.dumps(overrides, indent=2) + "\n")
    return json.loads((out / "eval.json").read_text())


def claim(work: Path, name: str) -> bool:
    """Create ``work/<name>.claim`` atomically; False when another process holds it."""
    try:
        fd = os.open(work / f"{name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def collect_runs(work: Path, runs_plan: list[tuple[str, str, dict]], *, part: str = "1/1", claim_runs: bool = False,
                 reuse: bool = False, summarize_only: bool = False, run=None) -> tuple[dict, list[str]]:
    """Run this part's share of ``runs_plan`` (every N-th from the K-th of ``part`` "K/N"; with ``claim_runs``,
    first come first served between processes), then gather the other parts' finished runs. Returns
    ``({method: [eval.json, ...]}, missing folder names)``; ``run`` replaces :func:`run_recipe`."""
    run = run or run_recipe
    k, n_parts = (int(x) for x in part.split("/"))
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    later, missing = [], []
    t0 = time.time()
    for i, (method, name, over) in enumerate(runs_plan):
        folder = work / name
        theirs = summarize_only or i % n_parts != k - 1
        if not theirs and claim_runs and finished(folder, over) is None:
            theirs = not claim(work, name)
        if theirs:
            later.append((method, folder, over))
            continue
        print(f"--- {name} ({time.time() - t0:.0f}s so far)", file=sys.stderr)
        runs[method].append(run(folder, over, reuse=reuse))
    for method, folder, over in later:  # other processes' runs, looked at once this one's are done
        ev = finished(folder, over)
        if ev is None:
            missing.append(folder.name)
        else:
            runs[method].append(ev)
    return runs, missing


def method_figures(summary: dict, runs: dict, choice: dict, base: dict, common: dict, *, seeds: int,
                   missing: list[str] = ()) -> dict:
    """The alignment pick, the base model, and per method: pooled behaviour rate and accuracy with intervals,
    VSPO's ``steered_share_above_base`` (0 without an aligned range), seconds per step, and the first step at
    the target (KM median, or a sentence saying it was not reached); then the setting (``seeds`` becomes the
    seeds per method when runs are ``missing``)."""
    steps = common["max_steps"]
    fig: dict = {"alignment_aligned": choice["aligned"], "alignment_alpha": choice["alpha"],
                 "alignment_behavior_rate": choice["behavior_rate"], "alignment_base_rate": choice["base_behavior_rate"],
                 "alignment_range": choice["range"],
                 "base_behavior_rate": base["behavior_rate"], "base_accuracy": base["accuracy"]}
    for m, s in summary.items():
        for key in ("behavior_rate", "accuracy"):
            fig[f"{key}_{m}"] = s[key]["rate"]
            fig[f"{key}_{m}_ci95"] = s[key]["ci95"]
        shares = [r["steered_share_above_base"] for r in runs[m] if r.get("steered_share_above_base") is not None]
        if m.startswith("vspo"):
            fig["steered_share_above_base" if m == "vspo" else f"steered_share_above_base_{m}"] = (
                statistics.mean(shares) if shares else 0.0)
        per_step = [r["train_seconds"] / r["steps"] for r in runs[m] if r.get("train_seconds") and r.get("steps")]
        if per_step:  # includes the curve evaluations (callbacks run inside training); teacher: traces + SFT
            fig[f"train_seconds_per_step_{m}"] = statistics.mean(per_step)
        fs = s["first_step"]
        if m == "guidance":  # no training: the steered base model either shows the target rate or not
            fig[f"first_step_at_target_{m}"] = 0 if fs["reached"] else "not reached (no training)"
        else:
            fig[f"first_step_at_target_{m}"] = (fs["km_median"] if fs["km_median"] is not None else
                                                f"not reached by step {steps} ({fs['reached']}/{fs['runs']} seeds)")
    fig.update({"seeds": seeds if not missing else {m: summary[m]["seeds"] for m in summary}, "steps": steps,
                "eval_n": common["eval_num_problems"], "target_behavior_rate": common["target_behavior_rate"],
                "guidance_alpha": common["guidance_alpha"], "alpha_max": common["alpha_max"]})
    return fig


RUN_KEYS = ("after", "curve", "first_step_at_target", "teacher", "steps", "train_seconds", "rollouts_per_step",
            "steered_share_above_base")


def methods_payload(fig: dict, summary: dict, align: dict, base: dict, common: dict, missing: list[str],
                    seconds: float, runs: dict) -> dict:
    """The results JSON: figures, summary, alignment check, base model, config and per run the evaluation and the
    per-step behaviour curve."""
    return {"figures": fig, "summary": summary, "alignment": align,
            "base": {k: base[k] for k in ("n", "behavior_rate", "accuracy", "mean_words")}, "config": common,
            "missing_runs": missing, "seconds": round(seconds),
            "runs": {m: [{k: r.get(k) for k in RUN_KEYS} for r in rs] for m, rs in runs.items()}}


def plot_methods(summary: dict, base: dict, runs: dict, png: Path, title: str) -> None:
    """Bars with Wilson intervals and seed dots (behaviour rate, accuracy) and the per-step behaviour curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = ["base", *summary]
    colors = ["gray", "C0", "C4", "C1", "C2", "C3"]
    for ax, key in zip(axes, ("behavior_rate", "accuracy")):
        vals = [base[key]] + [summary[m][key]["rate"] for m in summary]
        lo = [0.0] + [summary[m][key]["rate"] - summary[m][key]["ci95"][0] for m in summary]
        hi = [0.0] + [summary[m][key]["ci95"][1] - summary[m][key]["rate"] for m in summary]
        ax.bar(names, vals, yerr=[lo, hi], capsize=4, color=colors[:len(names)])
        for m_i, m in enumerate(summary, start=1):
            ax.scatter([m_i] * len(summary[m][key]["per_seed"]), summary[m][key]["per_seed"], color="k", s=10, zorder=3)
        ax.set_ylabel(key.replace("_", " ") + " (Wilson 95% CI, dots: seeds)")
        ax.set_ylim(0, 1)
        ax.tick_params(axis="x", labelrotation=20)
    ax = axes[2]
    for m_i, m in enumerate(summary, start=1):
        for j, r in enumerate(runs.get(m, [])):
            pts = [(0, base["behavior_rate"])] + [(p["step"], p["behavior_rate"]) for p in r.get("curve") or []]
            if len(pts) > 1:
                ax.plot(*zip(*pts), color=colors[m_i], alpha=0.7, marker=".", label=m if j == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("behaviour rate on the curve problems (greedy, unsteered)")
    ax.legend(fontsize=8)
    fig.suptitle(f"VSPO vs baselines, bundled model (CPU): {title}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# --- step time ------------------------------------------------------------------------------------------------

def step_timing(model_name: str, train_path: str, *, quick: bool, rounds: int, steps: int, threads: int = 1,
                completion_length: int = 32, max_minutes: float | None = None,
                work: Path = Path("/tmp/llmkit-bench-vspo")) -> dict:
    """Median step seconds of TRL's ``GRPOTrainer`` and ``VSPOTrainer`` (and, unless ``quick``, VSPO with
    token-level importance correction) on the same 32 GSM8K rows, ``rounds`` interleaved rounds of ``steps``
    steps each (a fresh copy of the model per trainer and round). Completions are forced to
    ``completion_length`` tokens so both trainers generate the same work. Returns the results JSON."""
    import copy

    import torch
    from datasets import Dataset
    from tqdm.auto import tqdm
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llmkit.models import load
    from llmkit.rewards import gsm8k_correctness, make_verbosity
    from llmkit.rewards.behaviors import contrastive_pairs
    from llmkit.steering import extract
    from llmkit.train.vspo.config import VSPOConfig
    from llmkit.train.vspo.data import build_rows, load_records
    from llmkit.train.vspo.trainer import VSPOTrainer

    torch.set_num_threads(threads)  # 1 by default: on a shared, overloaded CPU extra OpenMP threads spin and stall
    if model_name == "tiny":
        from llmkit.testing import tiny_llama, tiny_tokenizer

        model, tok = tiny_llama(hidden_size=256, num_layers=4), tiny_tokenizer()
    else:
        model, tok = load(model_name)
    rows = build_rows(load_records(train_path, 64, "train"), "verbosity")
    vec = extract(model, tok, contrastive_pairs("verbosity", [r["question"] for r in rows[-8:]]), behavior="verbosity")
    ds = Dataset.from_list(rows[:32])
    rewards = [gsm8k_correctness, make_verbosity(5, 40)]
    common = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": completion_length,
              "generation_kwargs": {"min_new_tokens": completion_length}, "learning_rate": 1e-6, "beta": 0.0,
              "report_to": "none", "use_cpu": True, "bf16": False, "logging_steps": 1, "save_strategy": "no",
              "seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    arms = {"grpo": None, "vspo": "none"} if quick else {"grpo": None, "vspo": "none", "vspo_is": "token_truncate"}
    timers = {name: StepTimer() for name in arms}
    bar = tqdm(total=rounds * len(arms), desc="rounds x trainers", file=sys.stderr)
    t_start, rounds_run = time.perf_counter(), 0
    for r in range(rounds):
        elapsed = time.perf_counter() - t_start
        if r and max_minutes is not None and elapsed * (r + 1) / r > max_minutes * 60:
            print(f"stopping after {r} rounds: --max-minutes {max_minutes:g}", file=sys.stderr)
            break
        rounds_run = r + 1
        for name, corr in arms.items():
            m = copy.deepcopy(model)
            if corr is None:
                cfg = GRPOConfig(output_dir=str(work / name), max_steps=steps, **common)
                t = GRPOTrainer(model=m, args=cfg, reward_funcs=rewards, train_dataset=ds, processing_class=tok,
                                callbacks=[timers[name]])
            else:
                cfg = VSPOConfig(output_dir=str(work / name), max_steps=steps, alpha_max=1.5, alpha_anneal="none",
                                 importance_correction=corr, **common)
                t = VSPOTrainer(model=m, args=cfg, reward_funcs=rewards, train_dataset=ds, processing_class=tok,
                                callbacks=[timers[name]], steering_vector=vec)
            t.train()
            bar.update(1)
    bar.close()
    return {"figures": timing_figures({name: tm.times for name, tm in timers.items()}),
            "step_times": {k: t.times for k, t in timers.items()}, "rounds": rounds_run, "steps_per_round": steps,
            "threads": threads, "model": model_name, "completion_length": completion_length, "rows_per_step": 8}


def timing_figures(step_times: dict[str, list[float]]) -> dict:
    """Median step seconds per trainer and VSPO's ratios to GRPO."""
    med = {name: statistics.median(ts) for name, ts in step_times.items()}
    fig = {"grpo_step_s": med["grpo"], "vspo_step_s": med["vspo"], "step_time_ratio_vs_grpo": med["vspo"] / med["grpo"]}
    if "vspo_is" in med:
        fig["vspo_is_step_s"] = med["vspo_is"]
        fig["step_time_ratio_is_vs_grpo"] = med["vspo_is"] / med["grpo"]
    return fig


# --- bandit abstraction ---------------------------------------------------------------------------------------

@dataclass
class BanditConfig:
    arms: int = 50
    correct: int = 10          # arms with task reward 1
    behavior_arms: int = 3     # correct arms that also show the behaviour
    p0: float = 0.05           # initial probability of the target arms together
    target: float = 0.9        # target pi(target)
    group: int = 8             # GRPO group size G
    groups: int = 4            # groups (prompts) per iteration
    lr: float = 2.0
    alpha_max: float = 6.0
    anneal: int = 300          # iterations over which a linear schedule reaches 0
    max_iters: int = 2000

    def __post_init__(self):
        if not 0 < self.p0 < 1:
            raise ValueError(f"p0 must be in (0, 1), got {self.p0}")
        if not 0 < self.behavior_arms <= self.correct < self.arms:
            raise ValueError("need 0 < behavior_arms <= correct < arms")
        if self.group < 2 or self.groups < 1 or self.max_iters < 1 or self.anneal < 1:
            raise ValueError("need group >= 2, groups >= 1, max_iters >= 1, anneal >= 1")


def make_problem(rng: np.random.Generator, cfg: BanditConfig):
    """(theta, reward, behaviour indicator, target mask) with pi(target) = p0 at theta."""
    c = np.zeros(cfg.arms)
    b = np.zeros(cfg.arms)
    c[:cfg.correct] = 1.0
    b[cfg.correct - cfg.behavior_arms:cfg.correct] = 1.0  # behaviour arms: correct answers given the desired way
    target = (c == 1) & (b == 1)
    theta = rng.normal(0.0, 1.0, cfg.arms)
    others = np.logaddexp.reduce(theta[~target])
    theta[target] = others + math.log(cfg.p0 / (1 - cfg.p0)) - math.log(target.sum())
    return theta, c + b, b, target


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max())
    return z / z.sum()


def alpha_top(method: str, it: int, cfg: BanditConfig) -> float:
    """The top of iteration ``it``'s intensity spread: 0 for reward shaping, fixed or linearly annealed."""
    if method == "reward_shaping":
        return 0.0
    if method.endswith("_fixed"):
        return cfg.alpha_max
    return cfg.alpha_max * max(0.0, 1.0 - it / cfg.anneal)


def run_bandit(method: str, seed: int, cfg: BanditConfig) -> tuple[int | None, list[float]]:
    """(first iteration with pi(target) >= target, or None if not reached within max_iters; the pi(target) curve)."""
    if method not in BANDIT_METHODS:
        raise ValueError(f"unknown method '{method}': choose from {', '.join(BANDIT_METHODS)}")
    rng = np.random.default_rng(seed)
    theta, reward, b, target = make_problem(np.random.default_rng(1000 + seed), cfg)
    s = None
    if method.startswith("vspo_aligned"):
        s = b.copy()
    elif method.startswith("vspo_misaligned"):
        s = np.zeros(cfg.arms)
        s[rng.choice(np.flatnonzero(b == 0), size=int(b.sum()), replace=False)] = 1.0
    curve: list[float] = []
    for it in range(cfg.max_iters):
        pi = softmax(theta)
        curve.append(float(pi[target].sum()))
        if curve[-1] >= cfg.target:
            return it, curve
        if s is None:
            draws = rng.choice(cfg.arms, size=(cfg.groups, cfg.group), p=pi)
        else:  # column g of every group comes from q_{alpha_g}
            alphas = np.linspace(0.0, alpha_top(method, it, cfg), cfg.group)
            draws = np.stack([rng.choice(cfg.arms, size=cfg.groups, p=softmax(theta + a * s)) for a in alphas], 1)
        grad = np.zeros_like(theta)
        for arms in draws:
            r = reward[arms]
            std = r.std()
            if std < 1e-8:
                continue
            adv = (r - r.mean()) / (std + 1e-4)
            grad -= pi * adv.sum()
            np.add.at(grad, arms, adv)
        theta = theta + cfg.lr * grad / (cfg.groups * cfg.group)
    return None, curve


def summarize_times(times: list[int | None], cap: int) -> dict:
    """Reached count, KM median (None = not reached by the cap) and the median over reached runs only."""
    done = [t for t in times if t is not None]
    return {"runs": len(times), "reached": len(done), "censored": len(times) - len(done),
            "km_median_iters": km_median(times, cap),
            "median_iters_reached_only": float(np.median(done)) if done else None, "cap": cap}


def speedup(shaping: dict, other: dict) -> tuple[float | None, str]:
    """Ratio of KM medians, shaping / other, and what it is: 'ratio', 'lower_bound' (shaping's median is past the
    cap, so the cap / other's median bounds the ratio from below) or 'undefined' (other's median is past the cap)."""
    a, b = shaping["km_median_iters"], other["km_median_iters"]
    if b is None:
        return None, "undefined"
    if a is None:
        return shaping["cap"] / max(b, 1.0), "lower_bound"
    return a / max(b, 1.0), "ratio"


def bandit_runs(base: dict, p0s: list[float], anneal_sweep: list[int], seeds: int, progress: bool = True):
    """Every method (and ``vspo_aligned`` at each ``anneal_sweep`` length) at every p0 over ``seeds`` seeds.
    Returns ``(times, curves)`` keyed ``<method>_p0_<p0>`` / ``vspo_aligned_anneal<N>_p0_<p0>``."""
    from tqdm.auto import tqdm

    times: dict[str, list] = {}
    curves: dict[str, list[list[float]]] = {}
    variants = [(m, None) for m in BANDIT_METHODS] + [("vspo_aligned", a) for a in anneal_sweep]
    jobs = [(p0, m, a, s) for p0 in p0s for m, a in variants for s in range(seeds)]
    for p0, m, a, s in tqdm(jobs, desc="bandit runs", file=sys.stderr, disable=not progress):
        key = f"{m}_p0_{p0:g}" if a is None else f"{m}_anneal{a}_p0_{p0:g}"
        n, curve = run_bandit(m, s, BanditConfig(p0=p0, **{**base, **({"anneal": a} if a is not None else {})}))
        times.setdefault(key, []).append(n)
        curves.setdefault(key, []).append(curve)
    return times, curves


def _median_or_cap(s: dict, cap: int):
    return s["km_median_iters"] if s["km_median_iters"] is not None else f"not reached by {cap}"


def bandit_figures(summary: dict, p0s: list[float], max_iters: int, anneal: int, anneal_sweep: list[int]) -> dict:
    """Per p0: reached counts and KM medians per method, each VSPO variant's speedup over reward shaping, and
    ``fixed_vs_anneal<N>_speedup`` (> 1: the fixed spread reaches the target sooner than annealing over N)."""
    fig: dict = {}
    for p0 in p0s:
        for m in BANDIT_METHODS:
            s = summary[f"{m}_p0_{p0:g}"]
            fig[f"{m}_p0_{p0:g}_reached"] = f"{s['reached']}/{s['runs']}"
            fig[f"{m}_p0_{p0:g}_km_median_iters"] = _median_or_cap(s, max_iters)
        shaping = summary[f"reward_shaping_p0_{p0:g}"]
        for m in BANDIT_METHODS[1:]:
            ratio, kind = speedup(shaping, summary[f"{m}_p0_{p0:g}"])
            name = f"speedup_{m.removeprefix('vspo_')}_vs_shaping_p0_{p0:g}"
            fig[name] = (f">= {ratio:.3g} (shaping censored)" if kind == "lower_bound" else
                         ratio if kind == "ratio" else "undefined (VSPO median past the cap)")
        fixed = summary[f"vspo_aligned_fixed_p0_{p0:g}"]
        for a in [anneal, *anneal_sweep]:
            key = f"vspo_aligned_p0_{p0:g}" if a == anneal else f"vspo_aligned_anneal{a}_p0_{p0:g}"
            s = summary[key]
            if a != anneal:
                fig[f"{key}_reached"] = f"{s['reached']}/{s['runs']}"
                fig[f"{key}_km_median_iters"] = _median_or_cap(s, max_iters)
            ratio, kind = speedup(s, fixed)  # > 1: the fixed spread gets there sooner
            fig[f"fixed_vs_anneal{a}_speedup_p0_{p0:g}"] = (ratio if kind == "ratio" else
                                                            f">= {ratio:.3g} (annealed censored)" if kind == "lower_bound"
                                                            else "undefined (fixed median past the cap)")
    return fig


def plot_bandit(curves: dict, p0s: list[float], anneal_sweep: list[int], target: float, png: Path) -> None:
    """Mean pi(target) per method and p0 over iterations (log scale); runs that stopped at the target hold their
    last value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(p0s), figsize=(6 * len(p0s), 4.2), squeeze=False)
    for ax, p0 in zip(axes[0], p0s):
        for m in [*BANDIT_METHODS, *(f"vspo_aligned_anneal{a}" for a in anneal_sweep)]:
            cs = curves[f"{m}_p0_{p0:g}"]
            n = max(len(c) for c in cs)
            padded = np.array([c + [c[-1]] * (n - len(c)) for c in cs])
            ax.plot(np.arange(1, n + 1), padded.mean(0), label=m, ls="--" if m.endswith("_fixed") else "-")
        ax.axhline(target, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"p0 = {p0:g}")
        ax.set_xlabel("iteration (log scale)")
        ax.set_ylabel("pi(target), mean over seeds")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("VSPO bandit: steered sampling (annealed / fixed spread) vs reward shaping")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
