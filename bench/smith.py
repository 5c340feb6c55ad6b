"""SMITH bench: sandbox overhead and escapes, and held-out-family macro accuracy of the bundled model against the
paper's baselines, all in one run.

    python bench/smith.py --quick      # small: 4 questions per held-out family, a few GRPO steps
    python bench/smith.py              # larger (still a CPU run of a few tens of minutes)

Conditions (held-out families only; none of them is seen in training):
  no_tools            the base model answers the questions directly
  reference_tools     the base model calls our reference tool for each family (ground-truth tools)
  warm_reference_tools  the warm-started policy (before GRPO) calls the reference tools: did the warm start teach
                      the call format? (full run only; ``use_call_parse_rate*``: share of replies holding a
                      parseable call; the quick run measures it on the base model and after warm start + GRPO)
  untrained_writer    the base model writes a tool per family from K examples (inference-time tool making), then
                      answers with it
  smith               warm start (SFT on reference traces of the TRAINING families, documented) + SMITH GRPO with
                      the three axes normalized separately; the trained policy writes the tools and answers
  combined_reward     the same, with schema+code+outcome summed into one scalar before the advantage (ablation)
  student_*           a frozen student that can call tools: the warm-started policy, frozen BEFORE GRPO, answers with
                      the held-out tools written by the GRPO-trained policy / by the untrained writer, with the
                      reference tools, and without tools
GRPO: every step holds use_share (0.5) use prompts; the pool starts with the training families' verified reference
tools, so use rollouts train from step one. Warm start (documented deviation, training families only): SFT on
reference-tool traces, one third use traces, two thirds build traces; --quick trains only the top 10 layers for 20
steps of 4 traces. The parts, their statistics and the frozen student are in ``llmkit.experiments.smith``; the
figures are on bench/results/smith.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PARTS = ("base", "warm", "smith", "combined_reward", "merge")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", default=str(REPO / "outputs" / "bench-smith"), help="scratch folder for the runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (the shared 2-core machine generated faster with 1)")
    ap.add_argument("--only", choices=PARTS, default=None,
                    help="run one part (results kept in the work folder); merge writes the JSON from the parts. "
                         "smith/combined_reward start from <work>/warm/model (made by the warm part)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = Path(args.work) / ("quick" if args.quick else "full")
    if args.only is None:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    from llmkit.experiments import smith as ex

    preset = ex.Preset.of(args.quick)
    store = ex.parts_store(work, preset)
    todo = PARTS if args.only is None else (args.only,)
    for part in todo:
        if part != "merge":
            ex.run_part(store, work, preset, part)
    if "merge" not in todo:
        return 0
    try:
        parts, written = ex.load_parts(store)
        student, student_train = ex.frozen_student(work, preset)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    res = ex.merge(parts, written, student, student_train, preset, started)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "smith_quick" if args.quick else "smith"
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    ex.plot(res, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / (stem + '.json')} and {stem}.png")
    print(json.dumps(ex.summary(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
