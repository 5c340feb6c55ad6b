"""VSPO against the paper's three baselines on the bundled model, in one run: behaviour rate and accuracy.

Target behaviour ``concise_answer`` (``llmkit.rewards.behaviors``, the paper's "response verbosity" in its rare
form), which the bundled model almost never shows unprompted (``base_behavior_rate``, same run): the sparse-reward
regime VSPO is about. The alignment check (``--align`` candidates on ``--align-n`` held-out problems) picks the
steering positions and intensities; then every arm runs through ``llmkit train vspo``: ``vspo`` (annealed spread,
``--aligned-share`` of each group inside the check's range: ``steered_share_above_base``), ``vspo_fixed`` (fixed
spread), ``grpo`` (reward shaping), ``teacher`` (SFT on steered samples) and ``guidance`` (steering at inference,
runs once). Per method: behaviour rate and accuracy on held-out GSM8K problems pooled over seeds with Wilson 95%
intervals, per-step behaviour curves, the first step at ``--target`` (Kaplan-Meier median). The machinery and
its description: ``llmkit.experiments.vspo``; results: bench/results/vspo.md.

Presets (shared 2-core CPU, one torch thread): full: 3 seeds, 4 steps of 8 rollouts, 64-token completions, 32
evaluation problems, a curve point every step on 16, alignment on 64, rollouts at temperature 0.7; split over processes with ``--part K/2
--reuse``, or ``--reuse --claim`` in each. ``--quick``: 1 seed, 24 evaluation problems, curve on 8. Writes
bench/results/vspo[_quick].json and a PNG. ``--timing``: per-step time of VSPO vs TRL's GRPOTrainer (tiny model
with ``--quick``), written to bench/results/vspo_timing[_quick].json.

    .venv/bin/python bench/vspo.py [--quick] [--reuse --claim]   # run the same command in two processes to split
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from llmkit.experiments import vspo as ex

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parents[1] / "../shared/data/gsm8k"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="methods: 1 seed, few steps, short completions; "
                    "--timing: a tiny random Llama, 3 rounds of 3 steps, no importance-correction arm")
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct (tiny for --timing --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per trained method (default 3, --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per trained run (default 4)")
    ap.add_argument("--eval-n", type=int, default=None, help="held-out problems per evaluation (32, --quick 24)")
    ap.add_argument("--curve-every", type=int, default=None, help="curve point every N steps (default 1)")
    ap.add_argument("--curve-n", type=int, default=None, help="problems per curve point (16, --quick 8)")
    ap.add_argument("--target", type=float, default=0.25, help="target behaviour rate for the first-step figure")
    ap.add_argument("--behavior", default="concise_answer")
    ap.add_argument("--max-words", type=int, default=30, help="concise_answer's word limit")
    ap.add_argument("--layer", type=int, default=None, help="steering layer (default: the recipe's, 60%% depth)")
    ap.add_argument("--temperature", type=float, default=0.7, help="rollout sampling temperature (the alignment "
                    "check samples at it too); at 1.0 the bundled model's samples are mostly incoherent, steered or not")
    ap.add_argument("--align", default="all:0.25,0.5,0.75,1", help="alignment check candidates "
                    "'positions:alpha,alpha;...' (positions all | answer); the runs use the picked one")
    ap.add_argument("--align-n", type=int, default=64, help="held-out problems of the alignment check")
    ap.add_argument("--alpha-max", type=float, default=None, help="VSPO's largest intensity (default: top of the "
                    "check's range)")
    ap.add_argument("--spread", default="aligned", choices=("aligned", "linspace", "uniform"),
                    help="VSPO's alpha_spread (aligned: needs a range from the alignment check, else linspace)")
    ap.add_argument("--aligned-share", type=float, default=1 / 3, help="least share of each group's rollouts "
                    "sampled inside the alignment check's range (alpha_spread aligned)")
    ap.add_argument("--guidance-alpha", type=float, default=None, help="intensity of guidance and teacher traces")
    ap.add_argument("--learning-rate", type=float, default=5e-5)
    ap.add_argument("--batch-size", type=int, default=8, help="rollouts per step (groups of 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="completion/eval budget (64)")
    ap.add_argument("--work-dir", default="/tmp/llmkit-bench-vspo-methods", help="run folders (outside the repo)")
    ap.add_argument("--reuse", action="store_true", help="keep the work folder: reuse the alignment check and "
                    "every finished run (a stopped or split run continues; the summary needs all of them)")
    ap.add_argument("--part", default="1/1", help="K/N: run only every N-th run starting at the K-th (split a "
                    "full run over processes; with --reuse the last part to finish writes the results)")
    ap.add_argument("--claim", action="store_true", help="with --reuse: processes sharing the work folder claim "
                    "runs first come first served (<run>.claim; delete those of a killed process)")
    ap.add_argument("--summarize-only", action="store_true", help="with --reuse: summarise the finished runs only")
    ap.add_argument("--timing", action="store_true", help="the per-step time benchmark instead")
    ap.add_argument("--rounds", type=int, default=None, help="--timing: rounds (4, --quick 3)")
    ap.add_argument("--round-steps", type=int, default=None, help="--timing: steps per trainer per round (3)")
    ap.add_argument("--completion-length", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-minutes", type=float, default=None, help="--timing: start no round expected to end later")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[1-9]\d*/[1-9]\d*", args.part) or int(args.part.split("/")[0]) > int(args.part.split("/")[1]):
        ap.error(f"--part must be K/N with 1 <= K <= N, got {args.part!r}")
    try:
        ex.parse_candidates(args.align)
    except ValueError as e:
        ap.error(str(e))
    return args


def timing(args) -> None:
    payload = ex.step_timing(args.model or ("tiny" if args.quick else "smollm2-135m-instruct"),
                             str(DATA / "train.jsonl"), quick=args.quick,
                             rounds=args.rounds or (3 if args.quick else 4), steps=args.round_steps or 3,
                             threads=args.threads, completion_length=args.completion_length,
                             max_minutes=args.max_minutes)
    ex.print_figures(payload["figures"])
    print(f"wrote {ex.write_results(RESULTS, 'vspo_timing_quick' if args.quick else 'vspo_timing', payload)}")
    print(json.dumps(payload["figures"]))


def methods(args) -> None:
    seeds, steps = args.seeds or (1 if args.quick else 3), args.steps or 4
    work = Path(args.work_dir) / ("quick" if args.quick else "full")
    if work.exists() and not args.reuse:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    common = ex.run_config(
        model=args.model or "smollm2-135m-instruct", behavior=args.behavior, max_words=args.max_words,
        train_path=str(DATA / "train.jsonl"), test_path=str(DATA / "test.jsonl"),
        eval_n=args.eval_n or (24 if args.quick else 32), tokens=args.max_new_tokens or 64, steps=steps,
        batch_size=args.batch_size, learning_rate=args.learning_rate, quick=args.quick,
        curve_every=args.curve_every or 1, curve_n=args.curve_n or (8 if args.quick else 16), target=args.target,
        layer=args.layer, temperature=args.temperature)
    t0 = time.time()
    align = ex.alignment_check(common, work, candidates=args.align, align_n=args.align_n, max_words=args.max_words,
                               threads=args.threads, reuse=args.reuse)
    ex.apply_pick(common, align["pick"], work / "steering", guidance_alpha=args.guidance_alpha,
                  alpha_max=args.alpha_max, spread=args.spread, aligned_share=args.aligned_share)
    runs, missing = ex.collect_runs(work, ex.plan(common, seeds), part=args.part, claim_runs=args.claim,
                                    reuse=args.reuse, summarize_only=args.summarize_only)
    if missing and args.summarize_only:
        print(f"summarising the finished runs only; missing: {', '.join(missing)}")
    elif missing:
        print(f"part {args.part} done; still missing: {', '.join(missing)} (run the other parts, then any part "
              "again with --reuse to summarise)")
        return
    summary = ex.summarize_methods(runs, steps)
    base = runs["guidance"][0]["before"]
    fig = ex.method_figures(summary, runs, align["pick"], base, common, seeds=seeds, missing=missing)
    ex.print_figures(fig)
    name = "vspo_quick" if args.quick else "vspo"
    out = ex.write_results(RESULTS, name, ex.methods_payload(fig, summary, align, base, common, missing,
                                                            time.time() - t0, runs))
    ex.plot_methods(summary, base, runs, RESULTS / f"{name}.png",
                    f"{args.behavior}: {seeds} seed(s), {steps} steps, alpha_max {common['alpha_max']:g}")
    print(f"wrote {out}")
    print(json.dumps({k: v for k, v in fig.items() if not k.endswith("_ci95")}))


def main(argv=None):
    args = parse_args(argv)
    return timing(args) if args.timing else methods(args)


if __name__ == "__main__":
    main()
