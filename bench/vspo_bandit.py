"""VSPO's bandit abstraction as a simulation (``llmkit.experiments.vspo``): iterations to reach a target rate.

Methods: reward-shaped GRPO; VSPO with an aligned steering direction, annealed (``vspo_aligned``, alpha_max
falls linearly to 0 over --anneal iterations, our default) or fixed (``vspo_aligned_fixed``, the spread
[0, alpha_max] throughout); the same two with a misaligned direction. For each initial target probability p0:
how many runs reach pi(target) >= --target within --max-iters, and the Kaplan-Meier median hitting time with
censored runs kept censored ("not reached" when fewer than half reach the cap); speedups are ratios of KM
medians, or lower bounds when reward shaping's median is past the cap. The schedule question (annealing is
our addition): ``vspo_aligned`` annealed over --anneal iterations and over each --anneal-sweep length, against
the fixed spread, as ``fixed_vs_anneal<N>_speedup`` (> 1: the fixed spread reaches the target sooner). Writes
bench/results/vspo_bandit[_quick].json and a PNG (mean pi(target) curves; runs that stopped at the target hold
their last value); results: bench/results/vspo_bandit.md.

    .venv/bin/python bench/vspo_bandit.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from llmkit.experiments import vspo as ex

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 seeds, cap 1000 iterations")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--p0", type=float, nargs="+", default=[0.05, 0.005],
                    help="initial probability of the target arms together (one run set per value)")
    for f in dataclasses.fields(ex.BanditConfig):
        if f.name != "p0":
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--anneal-sweep", type=int, nargs="*", default=[5, 20],
                    help="also run vspo_aligned with these (shorter) anneal lengths, to see when annealing costs")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_iters = min(args.max_iters, 1000)
    return args


def main(argv=None):
    args = parse_args(argv)
    seeds = args.seeds or (8 if args.quick else 24)
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(ex.BanditConfig) if f.name != "p0"}
    t0 = time.time()
    times, curves = ex.bandit_runs(base, args.p0, args.anneal_sweep, seeds)
    summary = {k: ex.summarize_times(v, args.max_iters) for k, v in times.items()}
    fig = ex.bandit_figures(summary, args.p0, args.max_iters, args.anneal, args.anneal_sweep)
    ex.print_figures(fig)
    name = "vspo_bandit_quick" if args.quick else "vspo_bandit"
    payload = {"figures": fig, "summary": summary, "iterations": times, "seeds": seeds,
               "config": {**base, "p0": args.p0}, "seconds": round(time.time() - t0, 1),
               "note": "iterations: null = censored (not reached by max_iters)"}
    out = ex.write_results(RESULTS, name, payload)
    ex.plot_bandit(curves, args.p0, args.anneal_sweep, args.target, RESULTS / f"{name}.png")
    print(f"wrote {out}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
