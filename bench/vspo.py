"""VSPO against the paper's three baselines on the bundled model, in one run: behaviour rate and accuracy.

Target behaviour ``concise_answer`` (``llmkit.rewards.behaviors``; the paper's "response verbosity" in its rare
form): at most ``--max-words`` words, a final answer, and the question's numbers used, so empty or content-free
short replies ("#### 20" included) score 0. The bundled SmolLM2-135M-Instruct, asked to solve step by step, almost
never answers this briefly (``base_behavior_rate``, measured in the same run): the sparse-reward regime VSPO is
about. ``--behavior confident_answer`` is rarer still, but its prompt-contrast vector does not elicit it on this
model (see recipes/configs/vspo/smollm2_concise_answer_gsm8k.yaml).

1. Alignment check (the paper's condition "steering-induced distributions sufficiently aligned with the target
   behavior"; ``llmkit.train.vspo.alignment``): the vector is extracted from the behaviour's contrastive prompts
   (16/32 training questions, layer 18 = 60% depth), then the base model samples at the rollout temperature
   (seeded) on ``--align-n`` held-out test problems (after the evaluation problems) unsteered and at each
   candidate of ``--align``
   (positions ``all``: activation addition on prompt and answer; ``answer``: from the last prompt token on) and
   intensity. Printed as ``alignment <candidate> alpha <a>: behavior_rate, accuracy, answer_rate, mean_words``;
   the pick (highest behaviour rate that keeps the answer rate and accuracy) sets the runs' steering positions,
   ``guidance_alpha`` (also the teacher's), ``alpha_max`` (top of the picked vector's range) and, with
   ``--spread aligned`` (default), ``aligned_alpha_range``: the intensities whose behaviour rate cleared the
   unsteered rate, inside which ``--aligned-share`` of every group's rollouts is sampled at every step.
   ``steered_share_above_base`` (figures) is the share of a VSPO run's rollouts that its schedule samples in that
   range (0 when the check found no such range).
2. Methods, all through ``llmkit train vspo`` (``llmkit.train.vspo.recipe``) with one config:

- ``vspo``: GRPO whose rollouts are steered at intensities spread over [0, alpha_max], annealed linearly to 0 by
  75% of the steps (our addition), with the aligned share held in the alignment check's range;
- ``vspo_fixed``: the same with a fixed spread (``alpha_anneal none``): the schedule comparison;
- ``grpo``: reward-shaped GRPO, the same rewards (task correctness + behaviour), no steering;
- ``teacher``: teacher-trace distillation, SFT on the steered model's own samples (as many completions and
  optimizer steps as the GRPO runs), evaluated unsteered;
- ``guidance``: no training, the base model steered at ``guidance_alpha`` at inference.

Per method: behaviour rate and accuracy (greedy, unsteered except guidance) on held-out GSM8K test problems, pooled
over seeds with Wilson 95% intervals and per-seed values; the first step at which a training curve (every
``--curve-every`` steps on the first ``--curve-n`` test problems) reaches ``--target`` (Kaplan-Meier median over
seeds; censored seeds reported as not reached). Base model and guidance are greedy and seed-free, so they run once.

Presets (sized for a shared 2-core CPU, one torch thread per process, run through /work/bin/heavy): full: 3 seeds,
4 steps of 8 rollouts (2 prompts x 4), 64-token completions and evaluations, 32 evaluation problems, a curve
point every step on 16, alignment on 32 problems; about 50 slot-minutes with a point every 2 steps (more with one
per step), split in two processes with ``--part 1/2`` and ``--part 2/2`` (``--reuse``), or shared first come
first served with ``--reuse --claim`` in each process.
``--quick``: 1 seed, 24 evaluation problems, curve on 8.
Writes bench/results/vspo[_quick].json and a PNG (bars with intervals and the behaviour-rate curves).
``--timing`` is the older per-step overhead benchmark (VSPO vs TRL's GRPOTrainer, tiny model with ``--quick``),
written to bench/results/vspo_timing[_quick].json.

    /work/bin/heavy .venv/bin/python bench/vspo.py [--quick] [--reuse --part K/2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
METHODS = ("vspo", "vspo_fixed", "grpo", "teacher", "guidance")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="methods: 1 seed, few steps, short completions; "
                    "--timing: a tiny random Llama, 3 rounds of 3 steps, no importance-correction arm")
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct (tiny for --timing --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per trained method (default 3, --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per trained run (default 4)")
    ap.add_argument("--eval-n", type=int, default=None, help="held-out problems per evaluation (32, --quick 24)")
    ap.add_argument("--curve-every", type=int, default=None, help="curve point every N steps (1: a behaviour "
                    "rate per step for every trained arm)")
    ap.add_argument("--curve-n", type=int, default=None, help="problems per curve point (16, --quick 8)")
    ap.add_argument("--target", type=float, default=0.25, help="target behaviour rate for the first-step figure")
    ap.add_argument("--behavior", default="concise_answer")
    ap.add_argument("--max-words", type=int, default=30, help="concise_answer's word limit")
    ap.add_argument("--layer", type=int, default=None, help="steering layer (default: the recipe's, 60%% depth)")
    ap.add_argument("--align", default="all:1,1.5;answer:2,4,6", help="alignment check: candidates "
                    "'positions:alpha,alpha;...' (positions all | answer: llmkit.steering.Steering); the runs use the "
                    "picked positions and intensity")
    ap.add_argument("--align-n", type=int, default=32, help="held-out problems of the alignment check")
    ap.add_argument("--alpha-max", type=float, default=None, help="VSPO's largest intensity (default: the top of "
                    "the alignment check's range)")
    ap.add_argument("--spread", default="aligned", choices=("aligned", "linspace", "uniform"),
                    help="VSPO's alpha_spread (aligned: needs a range from the alignment check, else linspace)")
    ap.add_argument("--aligned-share", type=float, default=1 / 3, help="least share of each group's rollouts "
                    "sampled inside the alignment check's range (alpha_spread aligned)")
    ap.add_argument("--guidance-alpha", type=float, default=None, help="steering intensity for guidance and the "
                    "teacher's traces (default: the alignment check's pick)")
    ap.add_argument("--learning-rate", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=8, help="rollouts per step (groups of 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="completion/eval budget (64)")
    ap.add_argument("--work-dir", default="/tmp/llmkit-bench-vspo-methods", help="run folders (outside the repo)")
    ap.add_argument("--reuse", action="store_true", help="keep the work folder: reuse the alignment check and "
                    "every finished run (a stopped or split run continues; the summary needs all of them)")
    ap.add_argument("--part", default="1/1", help="K/N: run only every N-th run starting at the K-th (split a "
                    "full run over processes; with --reuse the last part to finish writes the results)")
    ap.add_argument("--claim", action="store_true", help="with --reuse: processes sharing the work folder take "
                    "the runs in order, each claiming one (<run>.claim) before starting it; the last to finish "
                    "writes the results (delete stale .claim files of a killed process)")
    ap.add_argument("--summarize-only", action="store_true", help="with --reuse: run nothing more, summarise the "
                    "finished runs (the JSON lists the missing ones; seeds per method may then differ)")
    ap.add_argument("--timing", action="store_true", help="the per-step time benchmark instead")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--round-steps", type=int, default=None, help="--timing: steps per trainer per round")
    ap.add_argument("--completion-length", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-minutes", type=float, default=None, help="start no further round when another one "
                    "(at the mean round time so far) would end past this many minutes; the JSON records the rounds run")
    args = ap.parse_args()
    if not re.fullmatch(r"[1-9]\d*/[1-9]\d*", args.part) or int(args.part.split("/")[0]) > int(args.part.split("/")[1]):
        ap.error(f"--part must be K/N with 1 <= K <= N, got {args.part!r}")
    if not args.timing:
        return methods(args)
    rounds = args.rounds or (3 if args.quick else 4)
    steps = args.round_steps or 3
    args.model = args.model or ("tiny" if args.quick else "smollm2-135m-instruct")

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llmkit.models import load
    from llmkit.rewards import gsm8k_correctness, make_verbosity
    from llmkit.rewards.behaviors import contrastive_pairs
    from llmkit.steering import extract
    from llmkit.train.vspo.config import VSPOConfig
    from llmkit.train.vspo.data import build_rows, load_records
    from llmkit.train.vspo.trainer import VSPOTrainer

    torch.set_num_threads(args.threads)  # 1 by default: on a shared, overloaded CPU extra OpenMP threads spin and stall
    if args.model == "tiny":
        from llmkit.testing import tiny_llama, tiny_tokenizer

        model, tok = tiny_llama(hidden_size=256, num_layers=4), tiny_tokenizer()
    else:
        model, tok = load(args.model)
    rows = build_rows(load_records(str(REPO / "../shared/data/gsm8k/train.jsonl"), 64, "train"), "verbosity")
    vec = extract(model, tok, contrastive_pairs("verbosity", [r["question"] for r in rows[-8:]]), behavior="verbosity")
    ds = Dataset.from_list(rows[:32])
    rewards = [gsm8k_correctness, make_verbosity(5, 40)]
    common = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": args.completion_length,
                  "generation_kwargs": {"min_new_tokens": args.completion_length}, "learning_rate": 1e-6, "beta": 0.0,
                  "report_to": "none", "use_cpu": True, "bf16": False, "logging_steps": 1, "save_strategy": "no", "seed": 0,
                  "disable_tqdm": True, "dataloader_num_workers": 0}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    arms = {"grpo": None, "vspo": "none"} if args.quick else {"grpo": None, "vspo": "none", "vspo_is": "token_truncate"}
    timers = {name: StepTimer() for name in arms}
    tmp = Path("/tmp/llmkit-bench-vspo")
    from tqdm.auto import tqdm

    bar = tqdm(total=rounds * len(arms), desc="rounds x trainers", file=sys.stderr)
    t_start, rounds_run = time.perf_counter(), 0
    for r in range(rounds):
        elapsed = time.perf_counter() - t_start
        if r and args.max_minutes is not None and elapsed * (r + 1) / r > args.max_minutes * 60:
            print(f"stopping after {r} rounds: --max-minutes {args.max_minutes:g}", file=sys.stderr)
            break
        rounds_run = r + 1
        for name, corr in arms.items():
            m = copy.deepcopy(model)
            if corr is None:
                cfg = GRPOConfig(output_dir=str(tmp / name), max_steps=steps, **common)
                t = GRPOTrainer(model=m, args=cfg, reward_funcs=rewards, train_dataset=ds, processing_class=tok,
                                callbacks=[timers[name]])
            else:
                cfg = VSPOConfig(output_dir=str(tmp / name), max_steps=steps, alpha_max=1.5, alpha_anneal="none",
                                 importance_correction=corr, **common)
                t = VSPOTrainer(model=m, args=cfg, reward_funcs=rewards, train_dataset=ds, processing_class=tok,
                                callbacks=[timers[name]], steering_vector=vec)
            t.train()
            bar.update(1)
    bar.close()
    med = {name: statistics.median(tm.times) for name, tm in timers.items()}
    fig = {"grpo_step_s": med["grpo"], "vspo_step_s": med["vspo"], "step_time_ratio_vs_grpo": med["vspo"] / med["grpo"]}
    if "vspo_is" in med:
        fig["vspo_is_step_s"] = med["vspo_is"]
        fig["step_time_ratio_is_vs_grpo"] = med["vspo_is"] / med["grpo"]
    for k, v in fig.items():
        print(f"{k}: {v:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("vspo_timing_quick.json" if args.quick else "vspo_timing.json")
    out.write_text(json.dumps({"figures": fig, "step_times": {k: t.times for k, t in timers.items()},
                               "rounds": rounds_run, "steps_per_round": steps, "threads": args.threads, "model": args.model,
                               "completion_length": args.completion_length, "rows_per_step": 8}, indent=2) + "\n")
    print(f"wrote {out}")
    print(json.dumps(fig))


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


def alignment(args, common: dict, work: Path, tokens: int) -> dict:
    """The paper's alignment condition on held-out problems (``llmkit.train.vspo.alignment``): extract the vector
    from the behaviour's contrastive pairs, sample at the rollout temperature at each ``--align`` intensity,
    pick one."""
    import torch

    from llmkit.models import load
    from llmkit.rewards.behaviors import contrastive_pairs
    from llmkit.steering import SteeringVector, extract
    from llmkit.train.vspo.alignment import format_table, measure, pick
    from llmkit.train.vspo.data import build_rows, load_records

    vec_dir = work / "steering"
    cached = work / "alignment.json"
    temperature = float(common["temperature"])
    if args.reuse and cached.is_file() and (vec_dir / "steering.safetensors").is_file() \
            and json.loads(cached.read_text()).get("temperature") == temperature:
        result = json.loads(cached.read_text())
        for line in format_table(result["table"]):
            print(line)
        return result
    torch.set_num_threads(args.threads)
    model, tok = load(common["model_name_or_path"])
    train = build_rows(load_records(common["dataset_name"], common["dataset_limit"], "train"), args.behavior)
    start = common["eval_num_problems"]  # held out from the evaluation problems as well
    test = build_rows(load_records(common["eval_path"], start + args.align_n, "test"), args.behavior, 1)[start:]
    questions = [r["question"] for r in train[::-1][:common["steering_num_pairs"]]]  # as the recipe extracts it
    layers = common.get("steering_layers")
    vec = extract(model, tok, contrastive_pairs(args.behavior, questions), layers=layers, behavior=args.behavior)
    vec.save(vec_dir)
    layer = "+".join(map(str, vec.layers))
    cands = {}
    for spec in args.align.split(";"):  # "positions:a1,a2,..."
        pos, _, al = spec.partition(":")
        try:
            cands[f"layer{layer}-{pos}"] = (vec, pos, [float(a) for a in al.split(",")])
        except ValueError:
            raise SystemExit(f"--align: bad candidate {spec!r} (expected positions:alpha,alpha,...)") from None
        if pos not in ("all", "answer"):
            raise SystemExit(f"--align: positions must be all or answer, got {pos!r} in {spec!r}")
    table = measure(model, tok, test, cands, [], args.behavior, behavior_kwargs={"max_words": args.max_words},
                    max_new_tokens=tokens, batch_size=common["eval_batch_size"], progress=True,
                    temperature=temperature, seed=0)
    choice = pick(table)
    for line in format_table(table):
        print(line)
    result = {"table": table, "pick": choice, "n": len(test), "norms": SteeringVector.load(vec_dir).norms(),
              "max_new_tokens": tokens, "candidates": args.align, "temperature": temperature}
    cached.write_text(json.dumps(result, indent=2) + "\n")
    del model
    return result


RUN_MODES = {"vspo": {"mode": "vspo"}, "vspo_fixed": {"mode": "vspo", "alpha_anneal": "none"},
             "grpo": {"mode": "grpo"}, "teacher": {"mode": "teacher"}}


def methods(args) -> None:
    from llmkit.train.vspo.compare import summarize

    seeds = args.seeds or (1 if args.quick else 3)
    steps = args.steps or 4
    eval_n = args.eval_n or (24 if args.quick else 32)
    tokens = args.max_new_tokens or 64
    work = Path(args.work_dir) / ("quick" if args.quick else "full")
    if work.exists() and not args.reuse:
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    common = {
        "model_name_or_path": args.model or "smollm2-135m-instruct", "behavior": args.behavior,
        "verbosity_max_words": args.max_words,
        "dataset_name": str(REPO / "../shared/data/gsm8k/train.jsonl"), "dataset_limit": 512,
        "eval_path": str(REPO / "../shared/data/gsm8k/test.jsonl"), "eval_num_problems": eval_n,
        "eval_max_new_tokens": tokens, "eval_batch_size": 16, "steering_num_pairs": 16 if args.quick else 32,
        "alpha_anneal": "linear",
        "alpha_anneal_fraction": 0.75, "max_steps": steps, "per_device_train_batch_size": args.batch_size,
        "num_generations": 4, "max_completion_length": tokens, "temperature": 1.0,
        "learning_rate": args.learning_rate, "lr_scheduler_type": "constant", "beta": 0.0, "logging_steps": 1,
        "save_strategy": "no", "report_to": "none", "use_cpu": True, "bf16": False, "dataloader_num_workers": 0,
        "disable_tqdm": True, "curve_every_steps": args.curve_every or 1,
        "curve_num_problems": args.curve_n or (8 if args.quick else 16), "target_behavior_rate": args.target,
    }
    if args.layer is not None:
        common["steering_layers"] = [args.layer]
    t0 = time.time()
    align = alignment(args, common, work, tokens)
    choice = align["pick"]
    guidance_alpha = args.guidance_alpha if args.guidance_alpha is not None else (choice["alpha"] or 1.0)
    alpha_max = args.alpha_max if args.alpha_max is not None else (
        choice["range"][1] if choice.get("range") else guidance_alpha)
    common.update({"guidance_alpha": guidance_alpha, "alpha_max": alpha_max,
                   "steering_positions": choice.get("positions") or "all", "steering_vector": str(work / "steering")})
    spread = args.spread
    if choice.get("range"):
        common["aligned_alpha_range"] = list(choice["range"])
    elif spread == "aligned":
        print("the alignment check found no intensity range above the unsteered rate: VSPO spreads by linspace")
        spread = "linspace"
    common.update({"alpha_spread": spread, "aligned_share": args.aligned_share})
    plan = [("guidance", None)] + [(m, seed) for seed in range(seeds) for m in RUN_MODES]
    k, n_parts = (int(x) for x in args.part.split("/"))
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    missing, later = [], []
    for i, (mode, seed) in enumerate(plan):
        folder = work / (mode if seed is None else f"{mode}-{seed}")
        over = {**common, "eval_before": mode == "guidance"}
        over.update({"mode": "guidance"} if seed is None else {**RUN_MODES[mode], "seed": seed})
        theirs = args.summarize_only or i % n_parts != k - 1  # another part's run
        if not theirs and args.claim:  # first come, first served between processes sharing the work folder
            ev = finished(folder, over)
            if ev is None:
                try:
                    fd = os.open(work / f"{folder.name}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.write(fd, str(os.getpid()).encode())
                    os.close(fd)
                except FileExistsError:
                    theirs = True
        if theirs:
            later.append((mode, folder, over))
            continue
        print(f"--- {folder.name} ({time.time() - t0:.0f}s so far)", file=sys.stderr)
        runs[mode].append(run_recipe(folder, over, reuse=args.reuse))
    for mode, folder, over in later:  # other processes' runs, looked at once this one's are done
        ev = finished(folder, over)
        if ev is None:
            missing.append(folder.name)
        else:
            runs[mode].append(ev)
    if missing and args.summarize_only:
        print(f"summarising the finished runs only; missing: {', '.join(missing)}")
    elif missing:
        print(f"part {args.part} done; still missing: {', '.join(missing)} (run the other parts, then any part "
              "again with --reuse to summarise)")
        return
    summary = summarize(runs, steps)
    base = runs["guidance"][0]["before"]
    fig: dict = {"alignment_aligned": choice["aligned"], "alignment_alpha": choice["alpha"],
                 "alignment_behavior_rate": choice["behavior_rate"], "alignment_base_rate": choice["base_behavior_rate"],
                 "alignment_range": choice["range"],
                 "base_behavior_rate": base["behavior_rate"], "base_accuracy": base["accuracy"]}
    for m in summary:
        s = summary[m]
        fig[f"behavior_rate_{m}"] = s["behavior_rate"]["rate"]
        fig[f"behavior_rate_{m}_ci95"] = s["behavior_rate"]["ci95"]
        fig[f"accuracy_{m}"] = s["accuracy"]["rate"]
        fig[f"accuracy_{m}_ci95"] = s["accuracy"]["ci95"]
        shares = [r["steered_share_above_base"] for r in runs[m] if r.get("steered_share_above_base") is not None]
        if m.startswith("vspo"):  # from the schedule and the alignment check's range; 0 without a range
            share = statistics.mean(shares) if shares else 0.0
            fig["steered_share_above_base" if m == "vspo" else f"steered_share_above_base_{m}"] = share
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
                "eval_n": eval_n, "target_behavior_rate": args.target,
                "guidance_alpha": guidance_alpha, "alpha_max": alpha_max})
    for k_, v in fig.items():
        print(f"{k_}: {v:.3f}" if isinstance(v, float) else f"{k_}: {v}")
    RESULTS.mkdir(exist_ok=True)
    name = "vspo_quick" if args.quick else "vspo"
    payload = {"figures": fig, "summary": summary, "alignment": align,
               "base": {k_: base[k_] for k_ in ("n", "behavior_rate", "accuracy", "mean_words")}, "config": common,
               "missing_runs": missing, "seconds": round(time.time() - t0), "runs": {
               m: [{k_: r.get(k_) for k_ in ("after", "curve", "first_step_at_target", "teacher", "steps",
                                               "train_seconds", "rollouts_per_step", "steered_share_above_base")}
                   for r in rs] for m, rs in runs.items()}}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot_methods(summary, base, runs, RESULTS / f"{name}.png",
                 f"{args.behavior}: {seeds} seed(s), {steps} steps, alpha_max {alpha_max:g}")
    print(f"wrote {RESULTS / (name + '.json')}")
    print(json.dumps({k_: v for k_, v in fig.items() if not k_.endswith("_ci95")}))


def plot_methods(summary: dict, base: dict, runs: dict, png: Path, title: str) -> None:
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


if __name__ == "__main__":
    main()
