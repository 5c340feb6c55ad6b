"""VSPO's bandit abstraction as a simulation (``llmkit.train.vspo.bandit``): iterations to reach a target rate.

Methods: reward-shaped GRPO; VSPO with an aligned steering direction, annealed (``vspo_aligned``, alpha_max
falls linearly to 0 over --anneal iterations, our default) or fixed (``vspo_aligned_fixed``, the spread
[0, alpha_max] throughout); the same two with a misaligned direction. For each initial target probability p0:
how many runs reach pi(target) >= --target within --max-iters, and the Kaplan-Meier median hitting time with
censored runs kept censored ("not reached" when fewer than half reach the cap); speedups are ratios of KM
medians, or lower bounds when reward shaping's median is past the cap. The schedule question (annealing is
our addition): ``vspo_aligned`` annealed over --anneal iterations and over each --anneal-sweep length, against
the fixed spread, as ``fixed_vs_anneal<N>_speedup`` (> 1: the fixed spread reaches the target sooner). Writes
bench/results/vspo_bandit[_quick].json and a PNG (mean pi(target) curves; runs that stopped at the target hold
their last value).

    .venv/bin/python bench/vspo_bandit.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from llmkit.train.vspo.bandit import METHODS, BanditConfig, run, speedup, summarize

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 seeds, cap 1000 iterations")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--p0", type=float, nargs="+", default=[0.05, 0.005],
                    help="initial probability of the target arms together (one run set per value)")
    for f in dataclasses.fields(BanditConfig):
        if f.name != "p0":
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--anneal-sweep", type=int, nargs="*", default=[5, 20],
                    help="also run vspo_aligned with these (shorter) anneal lengths, to see when annealing costs")
    args = ap.parse_args()
    seeds = args.seeds or (8 if args.quick else 24)
    if args.quick:
        args.max_iters = min(args.max_iters, 1000)
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(BanditConfig) if f.name != "p0"}
    t0 = time.time()
    from tqdm.auto import tqdm

    times: dict[str, list] = {}
    curves: dict[str, list[list[float]]] = {}
    variants = [(m, None) for m in METHODS] + [("vspo_aligned", a) for a in args.anneal_sweep]
    jobs = [(p0, m, a, s) for p0 in args.p0 for m, a in variants for s in range(seeds)]
    for p0, m, a, s in tqdm(jobs, desc="bandit runs", file=sys.stderr):
        key = f"{m}_p0_{p0:g}" if a is None else f"{m}_anneal{a}_p0_{p0:g}"
        n, curve = run(m, s, BanditConfig(p0=p0, **{**base, **({"anneal": a} if a is not None else {})}))
        times.setdefault(key, []).append(n)
        curves.setdefault(key, []).append(curve)
    fig: dict = {}
    summary = {k: summarize(v, args.max_iters) for k, v in times.items()}
    for p0 in args.p0:
        for m in METHODS:
            s = summary[f"{m}_p0_{p0:g}"]
            fig[f"{m}_p0_{p0:g}_reached"] = f"{s['reached']}/{s['runs']}"
            med = s["km_median_iters"]
            fig[f"{m}_p0_{p0:g}_km_median_iters"] = med if med is not None else f"not reached by {args.max_iters}"
        shaping = summary[f"reward_shaping_p0_{p0:g}"]
        for m in METHODS[1:]:
            ratio, kind = speedup(shaping, summary[f"{m}_p0_{p0:g}"])
            name = f"speedup_{m.removeprefix('vspo_')}_vs_shaping_p0_{p0:g}"
            fig[name] = (f">= {ratio:.3g} (shaping censored)" if kind == "lower_bound" else
                         ratio if kind == "ratio" else "undefined (VSPO median past the cap)")
        fixed = summary[f"vspo_aligned_fixed_p0_{p0:g}"]
        for a in [args.anneal, *args.anneal_sweep]:
            key = f"vspo_aligned_p0_{p0:g}" if a == args.anneal else f"vspo_aligned_anneal{a}_p0_{p0:g}"
            s = summary[key]
            if a != args.anneal:
                fig[f"{key}_reached"] = f"{s['reached']}/{s['runs']}"
                fig[f"{key}_km_median_iters"] = (s["km_median_iters"] if s["km_median_iters"] is not None
                                                 else f"not reached by {args.max_iters}")
            ratio, kind = speedup(s, fixed)  # > 1: the fixed spread gets there sooner
            fig[f"fixed_vs_anneal{a}_speedup_p0_{p0:g}"] = (ratio if kind == "ratio" else
                                                            f">= {ratio:.3g} (annealed censored)" if kind == "lower_bound"
                                                            else "undefined (fixed median past the cap)")
    for k, v in fig.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    RESULTS.mkdir(exist_ok=True)
    name = "vspo_bandit_quick" if args.quick else "vspo_bandit"
    payload = {"figures": fig, "summary": summary, "iterations": times, "seeds": seeds,
               "config": {**base, "p0": args.p0}, "seconds": round(time.time() - t0, 1),
               "note": "iterations: null = censored (not reached by max_iters)"}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_, axes = plt.subplots(1, len(args.p0), figsize=(6 * len(args.p0), 4.2), squeeze=False)
    for ax, p0 in zip(axes[0], args.p0):
        for m in [*METHODS, *(f"vspo_aligned_anneal{a}" for a in args.anneal_sweep)]:
            cs = curves[f"{m}_p0_{p0:g}"]
            n = max(len(c) for c in cs)
            padded = np.array([c + [c[-1]] * (n - len(c)) for c in cs])
            ax.plot(np.arange(1, n + 1), padded.mean(0), label=m, ls="--" if m.endswith("_fixed") else "-")
        ax.axhline(args.target, color="gray", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"p0 = {p0:g}")
        ax.set_xlabel("iteration (log scale)")
        ax.set_ylabel("pi(target), mean over seeds")
    axes[0][0].legend(fontsize=8)
    fig_.suptitle("VSPO bandit: steered sampling (annealed / fixed spread) vs reward shaping")
    fig_.tight_layout()
    fig_.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / (name + '.json')}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
