"""VSPO's bandit abstraction as a simulation: iterations to reach a target behaviour rate.

The policy is a softmax over K responses (arms). Each arm is correct or not (task reward c); a few correct
arms also show the target behaviour (b). The shaped reward is ``c + b``; the goal is the behaviour arms
(the "target set", total probability p0 under the initial policy). Each iteration is one GRPO step: draw groups of G arms,
group-normalise the rewards into advantages, and ascend ``sum_i A_i * grad log pi(a_i)``.

- reward shaping (GRPO): the G arms are drawn from pi itself; while pi(target) is tiny, groups almost
  never contain a target arm and the behaviour reward gives no signal.
- VSPO: the g-th arm of a group is drawn from the steered distribution ``q_alpha ∝ pi * exp(alpha_g * s)``
  with ``alpha_g`` spread over [0, alpha_max] (annealed linearly to 0 over ``anneal`` iterations); the update
  uses the *unsteered* ``grad log pi`` (no importance weights), as the VSPO trainer does. ``s`` is the
  steering direction in logit space: **aligned** = the behaviour indicator b (steering raises the
  behaviour); **misaligned** = the indicator of as many arms without the behaviour.

Figures: median iterations (over seeds) until pi(target) >= --target, for each method; runs that never
reach it count as --max-iters (censored; the fraction reached is printed too), for each initial target probability p0. Writes
bench/results/vspo_bandit[_quick].json and a PNG of the mean pi(target) curves.

    .venv/bin/python bench/vspo_bandit.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def make_problem(rng: np.random.Generator, k: int, n_correct: int, n_behavior: int, p0: float):
    c = np.zeros(k)
    b = np.zeros(k)
    c[:n_correct] = 1.0
    b[n_correct - n_behavior:n_correct] = 1.0  # the behaviour arms are correct answers given the desired way
    target = (c == 1) & (b == 1)
    theta = rng.normal(0.0, 1.0, k)
    # put the target at initial probability p0
    others = np.logaddexp.reduce(theta[~target])
    theta[target] = others + np.log(p0 / (1 - p0)) - np.log(target.sum())
    return theta, c + b, b, target


def softmax(x):
    z = np.exp(x - x.max())
    return z / z.sum()


def run(method: str, seed: int, args) -> tuple[int, list[float]]:
    rng = np.random.default_rng(seed)
    theta, reward, b, target = make_problem(np.random.default_rng(1000 + seed), args.arms, args.correct,
                                            args.behavior_arms, args.p0)
    if method == "vspo_aligned":
        s = b.copy()
    elif method == "vspo_misaligned":
        s = np.zeros(args.arms)
        pool = np.flatnonzero(b == 0)
        s[rng.choice(pool, size=int(b.sum()), replace=False)] = 1.0
    else:
        s = None
    curve = []
    for it in range(args.max_iters):
        pi = softmax(theta)
        curve.append(float(pi[target].sum()))
        if curve[-1] >= args.target:
            return it, curve
        grad = np.zeros_like(theta)
        top = args.alpha_max * max(0.0, 1.0 - it / args.anneal) if s is not None else 0.0
        alphas = np.linspace(0.0, top, args.group)
        if s is None:
            draws = rng.choice(args.arms, size=(args.groups, args.group), p=pi)
        else:  # column g of every group comes from q_{alpha_g}
            draws = np.stack([rng.choice(args.arms, size=args.groups, p=softmax(theta + a * s)) for a in alphas], 1)
        for arms in draws:
            r = reward[arms]
            std = r.std()
            if std < 1e-8:
                continue  # a group with one reward value carries no advantage (GRPO)
            adv = (r - r.mean()) / (std + 1e-4)
            for a_i, arm in zip(adv, arms):
                g = -pi * a_i
                g[arm] += a_i
                grad += g
        theta += args.lr * grad / (args.groups * args.group)
    return args.max_iters, curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer seeds")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--arms", type=int, default=50)
    ap.add_argument("--correct", type=int, default=10, help="arms with task reward 1")
    ap.add_argument("--behavior-arms", type=int, default=3, help="correct arms that also show the behaviour")
    ap.add_argument("--p0", type=float, nargs="+", default=[0.05, 0.005],
                    help="initial probability of the target arms together (one run set per value)")
    ap.add_argument("--target", type=float, default=0.9, help="target behaviour rate pi(target)")
    ap.add_argument("--group", type=int, default=8, help="GRPO group size G")
    ap.add_argument("--groups", type=int, default=4, help="groups (prompts) per iteration")
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--alpha-max", type=float, default=6.0)
    ap.add_argument("--anneal", type=int, default=300, help="iterations over which alpha_max falls to 0")
    ap.add_argument("--max-iters", type=int, default=2000)
    args = ap.parse_args()
    seeds = args.seeds or (6 if args.quick else 24)
    if args.quick:
        args.max_iters = min(args.max_iters, 1000)
    methods = ("reward_shaping", "vspo_aligned", "vspo_misaligned")
    t0 = time.time()
    from tqdm.auto import tqdm

    iters: dict[str, list[int]] = {}
    curves: dict[str, list[list[float]]] = {}
    jobs = [(p0, m, s) for p0 in args.p0 for m in methods for s in range(seeds)]
    for p0, m, s in tqdm(jobs, desc="bandit runs", file=sys.stderr):
        key = f"{m}_p0_{p0:g}"
        n, curve = run(m, s, argparse.Namespace(**{**vars(args), "p0": p0}))
        iters.setdefault(key, []).append(n)
        curves.setdefault(key, []).append(curve)
    fig = {}
    for p0 in args.p0:
        for m in methods:
            key = f"{m}_p0_{p0:g}"
            fig[f"{key}_median_iters"] = float(np.median(iters[key]))
            fig[f"{key}_reached_frac"] = float(np.mean([n < args.max_iters for n in iters[key]]))
        for m in methods[1:]:
            fig[f"speedup_{m.split('_')[1]}_vs_shaping_p0_{p0:g}"] = (
                fig[f"reward_shaping_p0_{p0:g}_median_iters"] / max(fig[f"{m}_p0_{p0:g}_median_iters"], 1))
    for k, v in fig.items():
        print(f"{k}: {v:.3f}")
    RESULTS.mkdir(exist_ok=True)
    name = "vspo_bandit_quick" if args.quick else "vspo_bandit"
    payload = {"figures": fig, "iterations": iters, "seeds": seeds, "config": vars(args),
               "seconds": round(time.time() - t0, 1)}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.figure(figsize=(7, 4.2))
        for key, cs in curves.items():
            n = max(len(c) for c in cs)
            padded = np.array([c + [c[-1]] * (n - len(c)) for c in cs])
            plt.plot(np.arange(1, n + 1), padded.mean(0), label=key)
        plt.axhline(args.target, color="gray", ls="--", lw=1, label="target")
        plt.xscale("log")
        plt.xlabel("iteration (log scale)")
        plt.ylabel("pi(target)  (mean over seeds)")
        plt.title("VSPO bandit: steered sampling vs reward shaping")
        plt.legend()
        plt.tight_layout()
        plt.savefig(RESULTS / f"{name}.png", dpi=110)
    except Exception as e:  # noqa: BLE001 - the figures above are the result; a plot failure should not lose them
        print(f"plot skipped: {e}")
    print(f"wrote {RESULTS / (name + '.json')}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
