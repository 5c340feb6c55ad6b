"""LDPCache benchmark: privacy budget per answered query, accuracy, and eviction hit ratios.

Anchors in the same run: per-query LDP without a cache (budget, accuracy), LRU eviction at the same
capacity (hit ratio), a GPTCache-style threshold cache (hit ratio; not private, a reference only). Parts:
- the main run at equal epsilon per token over GSM8K workloads (llmkit/experiments/ldp_cache/
  equal_epsilon.py; workloads in workload.py), with the no-LLM hit-ratio sweep (runs.py);
- --eviction-ablation: multi-factor eviction with factors removed vs LRU, no LLM calls (runs.py);
- a fixed total budget B over Q queries with the candidate mechanism (fixed_budget.py): at the end of
  the main run, or alone with --fixed-budget-only (--quick: B/Q 4).
Results: bench/results/ldp_cache*.json and .png; pages bench/results/ldp_cache*.md (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

from llmkit.experiments.ldp_cache import equal_epsilon as E
from llmkit.experiments.ldp_cache.fixed_budget import config_of, fixed_budget_section, write_fixed_budget
from llmkit.experiments.ldp_cache.runs import MemoEmbedder, MemoMechanism, ablation_lines, run_ablation, say
from llmkit.experiments.ldp_cache.workload import WORKLOADS, load_arith_problems  # noqa: F401 - bench/select.py

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
BANK_ANSWERS = REPO / "bench" / "results" / "ldp_cache_parts" / "answers_arith.jsonl.gz"
OUT = REPO / "bench" / "results"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--quick", action="store_true", help="small workloads (several minutes on 1 core)")
    add("--workloads", default="uniform,zipf", help=f"comma list of: {', '.join(WORKLOADS)} (the _arith "
        "ones are written to ldp_cache_arith[_quick].json)")
    add("--problems", type=int, help="uniform[_arith]: distinct problems (quick 6; full 20, arith 120)")
    add("--pool", type=int, help="zipf[_arith]: problem pool (quick 12; full 40, arith 200)")
    add("--visits", type=int, help="visits per workload (2-4 variants each; quick 12; full 45, arith 240)")
    add("--server-engine", choices=("hf", "vllm"), default="hf", help="engine of the `llmkit serve` "
        "started here (hf: one thread, the default; vllm: faster on CPU)")
    add("--concurrency", type=int, default=16, help="LLM requests in flight at once (the server batches them)")
    add("--capacity", type=int, help="cache entries (quick 3, full 8)")
    add("--epsilon-per-token", type=float, default=38.0)
    add("--rr-epsilon", type=float, default=3.0)
    add("--sim-threshold", type=float, default=0.8)
    add("--gain-threshold", type=float, default=0.1)
    add("--max-tokens", type=int, default=256, help="answer length")
    add("--repeats", type=int, help="scheduler-coin seeds per cache arm (quick 5, full 20)")
    add("--sweep-seeds", type=int, help="workload seeds in the hit-ratio sweep (quick 3, full 5)")
    add("--sweep-repeats", type=int, help="scheduler seeds per workload seed in the sweep (quick 4, full 8)")
    add("--sweep-capacities", help="comma list (quick 2,3,4,6; full 2,3,4,6,8,12)")
    add("--seed", type=int, default=0)
    add("--eviction-ablation", action="store_true", help="only the no-LLM eviction ablation (multi-factor "
        "with factors removed vs LRU); writes ldp_cache_eviction_ablation.json")
    add("--max-steps", type=int, default=2, help="calculator steps per GSM8K problem, at most")
    add("--data", type=Path, default=DATA)
    add("--answers", type=Path, help="JSONL file of upstream answers to reuse and extend (resume a split run)")
    add("--upstream", help="use a running OpenAI-compatible server instead of starting `llmkit serve`")
    add("--model", help="model name to request (default: the upstream's first listed model). With --answers "
        "holding every answer, --upstream http://127.0.0.1:9 --model NAME replays a run without a server (a "
        "missing answer then fails loudly)")
    fb = ap.add_argument_group("fixed total budget (issue 23; candidate mechanism; fixed_budget.py)").add_argument
    fb("--fixed-budget-only", action="store_true", help="only the fixed-budget experiment; writes "
       "ldp_cache_fixed_budget[_quick].json/.png")
    fb("--budgets", help="comma list of per-query budgets B/Q (quick 4; full 1,2,3,4,6,8,12)")
    fb("--bank", type=int, default=120, help="public candidate bank: the first N one-step arithmetic "
       "problems (their questions)")
    fb("--budget-visits", type=int, default=240, help="visits per fixed-budget stream")
    fb("--budget-repeats", type=int, help="mechanism/scheduler seeds per arm and budget (quick 5, full 10)")
    fb("--bit-share", type=float, default=0.25, help="the scheduler bit's epsilon as a share of B/Q (at "
       "most --rr-epsilon)")
    fb("--fixed-budget-out", help="file stem for the fixed-budget JSON/PNG (default "
       "ldp_cache_fixed_budget[_quick])")
    fb("--budget-answers", type=Path, default=BANK_ANSWERS, help="answers file for the bank's questions "
       "(the session-4 arithmetic run's plain asks)")
    return ap


def fixed_budget(args, embedder, plan, mechanism) -> dict:
    section = fixed_budget_section(args, embedder, plan.capacity, args.max_tokens, mechanism, cwd=REPO)[0]
    stem = args.fixed_budget_out or "ldp_cache_fixed_budget" + "_quick" * args.quick
    path = write_fixed_budget(section, OUT, stem)
    say(f"wrote {path} and {path.stem}.png")
    return section


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        plan = E.make_plan(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if not args.data.is_file():
        print(f"no such file: {args.data}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SystemExit: `llmkit serve` is still stopped
    from tqdm import tqdm

    from llmkit.serving.ldp_cache import ExponentialTokenMechanism, LDPScheduler
    from llmkit.serving.ldp_cache.embedder import MiniLMEmbedder

    problem_sets, streams = E.load_streams(plan, args.data, args.seed, args.max_steps)
    for k in plan.kinds:
        say(E.stream_line(k, streams[k], plan.visits[k]))
    t0 = time.time()
    mechanism = MemoMechanism(ExponentialTokenMechanism.from_minilm(args.epsilon_per_token))
    embedder = MemoEmbedder(MiniLMEmbedder())

    sched = partial(LDPScheduler, args.rr_epsilon, args.sim_threshold, args.gain_threshold)
    if args.eviction_ablation:
        res = run_ablation(plan.kinds, problem_sets, plan.visits, mechanism, embedder, sched, seed=args.seed,
                           capacities=plan.capacities, workload_seeds=plan.sweep_seeds,
                           scheduler_seeds=plan.sweep_repeats, config=config_of(args))
        for line in ablation_lines(res):
            say(line)
        (OUT / "ldp_cache_eviction_ablation.json").write_text(json.dumps(res, indent=2))
        say(f"wrote {OUT / 'ldp_cache_eviction_ablation.json'} ({time.time() - t0:.0f} s; no LLM calls)")
        return 0
    if args.fixed_budget_only:
        print(json.dumps(fixed_budget(args, embedder, plan, mechanism)["figures"]))
        return 0

    run = E.answer_and_evaluate(args, plan, problem_sets, streams, mechanism=mechanism, embedder=embedder,
                                sched=sched, cwd=REPO,
                                progress=lambda it, desc: tqdm(it, desc=desc, file=sys.stderr))
    say(E.header_line(args, plan, run))
    figures = E.run_figures(plan, streams, run["results"])
    say(f"LLM calls {run['calls']} (+{run['extra_calls']} beyond the baseline's and the plain asks); "
        f"{time.time() - t0:.0f} s")
    fb_section = fixed_budget(args, embedder, plan, mechanism)
    figures.update(fb_section["figures"])
    result = E.build_result(plan, run["results"], figures, model=run["model"], max_tokens=args.max_tokens,
                            config=config_of(args), mechanism=mechanism.name, fixed_budget=fb_section)
    path = E.write_result(result, OUT, E.result_stem(plan.kinds, args.quick))
    say(f"wrote {path} and {path.stem}.png")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
