"""Per-step time of the VSPO trainer vs TRL's GRPOTrainer with the same config, in the same run.

Both trainers get the same model weights, data, seed and GRPO config; VSPO adds its steering hook
(per-row intensities spread over each group) around generation. Every rollout is forced to the full
``max_completion_length`` (``min_new_tokens``) so that both do the same amount of generation and the ratio
measures VSPO's overhead, not how long the steered answers happen to be. ``--quick`` uses a tiny random Llama (there the hook's cost is
relatively larger than on a real model, so the quick ratio is a pessimistic bound). Rounds alternate the trainers
(GRPO k steps, VSPO k steps, ...) so load changes on this shared machine hit both; the figure is the ratio
of the per-step medians. The full run also times VSPO with the truncated importance correction (one
extra steered forward pass per generation batch).

    .venv/bin/python bench/vspo.py [--quick] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny random Llama (4 layers, hidden 256), 3 rounds of "
                    "3 steps, no importance-correction arm")
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct (full), tiny (--quick)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per trainer per round")
    ap.add_argument("--completion-length", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-minutes", type=float, default=None, help="start no further round when another one "
                    "(at the mean round time so far) would end past this many minutes; the JSON records the rounds run")
    ap.add_argument("--compare-runs", nargs=2, metavar=("VSPO_DIR", "GRPO_DIR"), default=None,
                    help="instead of timing: summarise two finished `llmkit train vspo` runs (VSPO and --mode grpo): "
                    "behaviour rate and accuracy before/after, and their reward curves in one plot")
    args = ap.parse_args()
    if args.compare_runs:
        return compare_runs(*map(Path, args.compare_runs))
    rounds = args.rounds or (3 if args.quick else 4)
    steps = args.steps or 3
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
    out = RESULTS / ("vspo_quick.json" if args.quick else "vspo.json")
    out.write_text(json.dumps({"figures": fig, "step_times": {k: t.times for k, t in timers.items()},
                               "rounds": rounds_run, "steps_per_round": steps, "threads": args.threads, "model": args.model,
                               "completion_length": args.completion_length, "rows_per_step": 8}, indent=2) + "\n")
    print(f"wrote {out}")
    print(json.dumps(fig))


def compare_runs(vspo_dir: Path, grpo_dir: Path) -> None:
    from llmkit.train.common import plot_curves

    fig, series = {}, {}
    ev = {name: json.loads((d / "eval.json").read_text()) for name, d in (("vspo", vspo_dir), ("grpo", grpo_dir))}
    before = ev["vspo"].get("before") or ev["grpo"].get("before")
    if before:
        fig.update({"before_accuracy": before["accuracy"], "before_behavior_rate": before["behavior_rate"],
                    "before_mean_words": before["mean_words"]})
    for name, d in (("vspo", vspo_dir), ("grpo", grpo_dir)):
        after = ev[name]["after"]
        fig.update({f"{name}_after_accuracy": after["accuracy"], f"{name}_after_behavior_rate": after["behavior_rate"],
                    f"{name}_after_mean_words": after["mean_words"], f"{name}_steps": ev[name].get("steps")})
        for key in ("reward", "rewards/verbosity/mean", "rewards/gsm8k_correctness/mean"):
            xs, ys = [], []
            for line in (d / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if isinstance(rec.get(key), (int, float)):
                    xs.append(rec["step"])
                    ys.append(rec[key])
            series[f"{name} {key}"] = (xs, ys)
    fig["n_eval_problems"] = (before or ev["vspo"]["after"])["n"]
    for k, v in fig.items():
        print(f"{k}: {v}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "vspo_bundled_run.json"
    out.write_text(json.dumps({"figures": fig, "eval": ev, "runs": [str(vspo_dir), str(grpo_dir)]}, indent=2) + "\n")
    plot_curves(series, RESULTS / "vspo_bundled_run.png", title="VSPO vs reward-shaped GRPO (bundled model, CPU)",
                ylabel="mean reward per step")
    print(f"wrote {out}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
