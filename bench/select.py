"""Few-evaluation selection and tuning: the four optimization backends in their papers' settings, and
``llmkit select`` on the bundled model.

Figures (ratios / rates measured in the same run):
- tci_correct_rate: beta-EB-TCI (delta = 0.1) right on a Bernoulli instance with a unique best arm;
  tci_samples_vs_uniform: its mean stopping time / uniform allocation's with the same GLR stopping rule;
  tci_tau_vs_tstar_log: mean stopping time / (T*_beta(mu) log(1/delta)) at delta = 1e-3 and 1e-12.
- bisection_success_rate: localize_minimizer within eps on four noisy convex functions.
- es_sphere_success_rate: truncated Riemannian (1+1)-ES reaches |<x, u1>| >= 0.95 on sparse PCA over
  S^99 within 2000 evaluations (success fixed before the run; Euclidean ES projected back and CMA-ES at the
  same budget, sigma0 and starts beside it); es_sphere_evals_vs_euclidean / _vs_cma: median evaluations
  to that success, Riemannian / baseline (quartiles in es_sphere_evals_quartiles). es_stiefel_*: the same
  for 12-component sparse PCA over St(20, 12) (subspace overlap >= 0.95 within 3000), where 78 of the 240
  ambient directions are normal to the manifold; on the sphere only 1 of n is, so there the paper's
  d-vs-n advantage is a factor 1 - 1/n and the ratio is expected near 1 (see llmkit/optim/es.py).
  es_ratio_by_normal_share: that ratio on more spheres / Stiefel manifolds against 1 - d/n (plotted).
- bts_vs_random_regret_ratio: median simple regret of GP batched Thompson sampling (batches of 4) /
  random search, equal evaluations, Branin and Hartmann-3 (geometric mean of the two ratios).
- select_evals_vs_full: ``llmkit.selection.select_best`` (what ``llmkit select`` runs) over three
  generation settings of the bundled model on a GSM8K-derived one-step arithmetic subset (the
  construction of bench/ldp_cache.py, on which the model is not at 0%), graded by the GSM8K grader: each
  arm's answer to every problem is generated once (that is the full evaluation), then the top-two rule is
  run over seeds reading those answers through ``llmkit.selection.TableScorer``, which spends them the way
  the CLI's ``EngineScorer`` does: a miss generates that problem and the arm's next upcoming ones together,
  ``--batch-size`` (= lookahead, CLI default 8; ``select_lookahead`` in the JSON) at most, and every answer
  so generated counts as spent. The ratio is those answers / all of them (what ``llmkit select
  --batch-size 8`` would have generated); ``select_evals_vs_full_no_lookahead`` is the same runs counting
  only the answers the rule actually read (``--batch-size 1``). select_winner_match_rate says how often it
  named the full evaluation's winner.

    .venv/bin/python bench/select.py [--quick] [--skip-model] [--only es,bo]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the stdlib's `select` module (the issue fixes the name). Run as a script, keep its
# folder off the import path. Run as any other bench script, that folder is sys.path[0] and `import select`
# (subprocess, selectors, asyncio ...) lands here: hand the importer the real module instead.
_HERE = Path(__file__).resolve().parent
if __name__ == "select":
    # (the rest of this file still runs as a throwaway module: only imports and definitions, cheap)
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    del sys.modules["select"]
    try:
        import select as _real  # the stdlib's (lib-dynload)
    finally:
        sys.path[:] = _saved
    sys.modules["select"] = _real
else:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import importlib.util
import json
import math
import time

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


def bandit_figures(seeds: int) -> dict:
    from llmkit.optim.bandits import characteristic_time, identify_best

    mu = np.array([0.7, 0.5, 0.4, 0.3])

    def run(delta, s, alloc="top-two"):
        rng = np.random.default_rng(s)
        return identify_best(lambda k: float(rng.random() < mu[k]), 4, delta, allocation=alloc)

    tt = [run(0.1, s) for s in range(seeds)]
    un = [run(0.1, s, "uniform") for s in range(seeds)]
    t_star = characteristic_time(mu)
    track = {}
    for d in (1e-3, 1e-12):
        track[str(d)] = float(np.mean([run(d, s)[1] for s in range(max(4, seeds // 4))]) / (t_star * math.log(1 / d)))
    return {"tci_correct_rate": float(np.mean([a == 0 for a, _ in tt])),
            "uniform_correct_rate": float(np.mean([a == 0 for a, _ in un])),
            "tci_mean_samples": float(np.mean([n for _, n in tt])),
            "uniform_mean_samples": float(np.mean([n for _, n in un])),
            "tci_samples_vs_uniform": float(np.mean([n for _, n in tt]) / np.mean([n for _, n in un])),
            "tci_tau_vs_tstar_log": track, "t_star": t_star}


def bisection_figures(seeds: int) -> dict:
    from llmkit.optim.bandits import localize_minimizer

    funcs = {"quadratic": (lambda x: 4 * (x - 0.3) ** 2, 0.3, 0.05), "abs": (lambda x: abs(x - 0.71), 0.71, 0.1),
             "exp": (lambda x: math.exp(x) - 2 * x, math.log(2), 0.02),
             "boundary": (lambda x: (x + 1.5) ** 2, -1.0, 0.1)}
    hits, evals = [], {}
    for name, (f, xs, sig) in funcs.items():
        ev = []
        for s in range(seeds):
            rng = np.random.default_rng(s)
            x, n = localize_minimizer(lambda x, f=f, sig=sig, rng=rng: f(x) + sig * rng.standard_normal(), -1, 2, 0.05, 0.1, sigma=sig)
            hits.append(abs(x - xs) <= 0.05)
            ev.append(n)
        evals[name] = float(np.mean(ev))
    return {"bisection_success_rate": float(np.mean(hits)), "bisection_mean_evals": evals}


ES_SPHERE = {"n": 100, "p": 1, "budget": 2000, "sigma0": 0.05, "target": 0.95}
ES_STIEFEL = {"n": 20, "p": 12, "budget": 3000, "sigma0": 0.05, "target": 0.95}
# more (n, p, budget) for the Riemannian / ambient ratio against the share of ambient directions normal to M
ES_SWEEP = [(30, 1, 1500), (40, 4, 3000), (20, 6, 2000), (12, 8, 1500)]


def es_figures(seeds: int) -> dict:
    from llmkit.optim.es import ES_METHODS, compare_on_sparse_pca, intrinsic_dim, summarize_evaluations

    out = {"es_setting": {"sphere": ES_SPHERE, "stiefel": ES_STIEFEL, "seeds": seeds,
                          "success": "best point so far reaches overlap >= target within the budget",
                          "evals": "median [q1, q3] evaluations to success, a miss counted as budget + 1"}}
    for name, cfg, methods in (("sphere", ES_SPHERE, ES_METHODS), ("stiefel", ES_STIEFEL, ("riemannian", "euclidean"))):
        runs = compare_on_sparse_pca(cfg["n"], p=cfg["p"], seeds=seeds, budget=cfg["budget"], sigma0=cfg["sigma0"],
                                     target=cfg["target"], methods=methods)
        summ = {m: summarize_evaluations(r["evals"], cfg["budget"]) for m, r in runs.items()}
        for m in methods:
            suffix = "" if m == "riemannian" else f"_{m}"
            out[f"es_{name}_success_rate{suffix}"] = summ[m]["success_rate"]
            out[f"es_{name}_median_evals{suffix}"] = summ[m]["median"]
            out[f"es_{name}_median_overlap{suffix}"] = float(np.median(runs[m]["overlap"]))
        for m in methods[1:]:
            out[f"es_{name}_evals_vs_{m}"] = summ["riemannian"]["median"] / summ[m]["median"]
        out[f"es_{name}_evals_quartiles"] = {m: [summ[m]["q1"], summ[m]["median"], summ[m]["q3"]] for m in methods}
        out[f"es_{name}_runs"] = runs
    sweep = [(ES_SPHERE["n"], 1, None, out["es_sphere_evals_vs_euclidean"]),
             (ES_STIEFEL["n"], ES_STIEFEL["p"], None, out["es_stiefel_evals_vs_euclidean"])]
    for n, p, budget in ES_SWEEP:
        runs = compare_on_sparse_pca(n, p=p, seeds=seeds, budget=budget, methods=("riemannian", "euclidean"))
        med = {m: summarize_evaluations(r["evals"], budget)["median"] for m, r in runs.items()}
        sweep.append((n, p, budget, med["riemannian"] / med["euclidean"]))
    out["es_ratio_by_normal_share"] = sorted(
        ({"n": n, "p": p, "budget": b, "normal_share": 1 - intrinsic_dim((n, p) if p > 1 else (n,),
                                                                          "stiefel" if p > 1 else "sphere") / (n * p),
          "evals_vs_euclidean": r} for n, p, b, r in sweep), key=lambda e: e["normal_share"])
    return out


def _manifold_label(e: dict) -> str:
    return f"S^{e['n'] - 1}" if e["p"] == 1 else f"St({e['n']},{e['p']})"


def bo_figures(seeds: int) -> dict:
    import torch

    from llmkit.optim.bo import TEST_FUNCTIONS, BatchedThompsonSampling, random_search, run_ask_tell

    torch.set_num_threads(1)
    ratios = {}
    for name in ("branin", "hartmann3"):
        f, b, fmin = TEST_FUNCTIONS[name]
        bts = [run_ask_tell(BatchedThompsonSampling(b, 4, seed=s), f, 32)[1] - fmin for s in range(seeds)]
        rs = [random_search(f, b, 32, seed=s)[1] - fmin for s in range(seeds)]
        ratios[name] = float(np.median(bts) / np.median(rs))
    return {"bts_vs_random_regret_ratio": float(np.exp(np.mean(np.log(list(ratios.values()))))),
            "bts_vs_random_by_function": ratios}


SETTINGS = [  # three generation settings of the bundled model that should differ in accuracy
    {"name": "step-by-step greedy, 64 tokens", "max_new_tokens": 64},
    {"name": "number-only sampled T=1.5", "system_prompt": "Reply with only the final number.",
     "max_new_tokens": 12, "temperature": 1.5, "seed": 1},
    {"name": "2-token budget", "max_new_tokens": 2},
]


def _cli_batch_size(register) -> int:
    """``llmkit select``'s default --batch-size (its lookahead), read from the parser itself."""
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return int(ap.parse_args(["select"]).batch_size)


def select_figures(n_problems: int, seeds: int) -> dict:
    spec = importlib.util.spec_from_file_location("_ldp_cache_bench", Path(__file__).resolve().parent / "ldp_cache.py")
    ldp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ldp)
    load_arith_problems = ldp.load_arith_problems

    from llmkit.commands.select import register as _register_select
    from llmkit.engines import get_engine
    from llmkit.evals import get_task
    from llmkit.selection import EngineScorer, TableScorer, arms_from_config, select_best

    data = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    problems = [{"question": p["question"], "answer": f"#### {p['gold']}"}
                for p in load_arith_problems(data, n_problems, seed=0)]
    task = get_task("gsm8k")
    arms = arms_from_config(SETTINGS)
    t0 = time.time()
    scorer = EngineScorer(arms, problems, task, lambda m: get_engine("hf", m, batch_size=16), lookahead=n_problems)
    table = np.array([[scorer.score(a, i, list(range(n_problems))) for i in range(n_problems)]
                      for a in range(len(arms))])
    scorer.close()
    full_acc = table.mean(1)
    full_winner = int(np.argmax(full_acc))
    lookahead = _cli_batch_size(_register_select)
    runs, bare = [], []
    for s in range(seeds):
        sc = TableScorer(table, lookahead=lookahead)  # the CLI's lookahead batching and cost accounting
        runs.append(select_best(sc.score, len(arms), n_problems, delta=0.05, seed=s,
                                generated=lambda sc=sc: len(sc.cache)))
        bare.append(select_best(lambda a, i, *_: float(table[a, i]), len(arms), n_problems, delta=0.05, seed=s))
    return {"select_evals_vs_full": float(np.mean([r["evals_vs_full"] for r in runs])),
            "select_lookahead": lookahead,
            "select_evals_vs_full_no_lookahead": float(np.mean([r["evals_vs_full"] for r in bare])),
            "select_winner_match_rate": float(np.mean([r["winner"] == full_winner for r in runs])),
            "select_stopped_rate": float(np.mean([r["stopped"] for r in runs])),
            "select_full_accuracy": {a.name: float(v) for a, v in zip(arms, full_acc)},
            "select_problems": n_problems, "select_generation_s": round(time.time() - t0, 1),
            "select_example_run": runs[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true", help="no bundled-model run (select figure left out)")
    ap.add_argument("--problems", type=int, default=None, help="problems in the select pool")
    ap.add_argument("--only", default=None,
                    help="comma list of parts to run (bandits,bisection,es,bo,select), for iteration: prints the "
                         "figures but writes no result files (the committed JSON is always a complete run)")
    args = ap.parse_args()
    q = args.quick
    parts = {"bandits", "bisection", "es", "bo", "select"}
    only = set(args.only.split(",")) if args.only else parts
    if only - parts:
        ap.error(f"--only: unknown part(s) {sorted(only - parts)}; choose from {sorted(parts)}")
    res = {"quick": q}
    for name, fn, arg in (("bandits", bandit_figures, 20 if q else 100), ("bisection", bisection_figures, 6 if q else 25),
                          ("es", es_figures, 8 if q else 20), ("bo", bo_figures, 4 if q else 8)):
        if name not in only:
            continue
        t0 = time.time()
        res.update(fn(arg))
        print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in res.items() if isinstance(v, float)
                                      and k.startswith({"bandits": "tci", "bisection": "bisection", "es": "es",
                                                        "bo": "bts"}[name])) + f" ({time.time() - t0:.0f}s)",
              flush=True)
        if name == "es":
            print("es_ratio_by_normal_share (1 - d/n -> median evals Riemannian / ambient ES): "
                  + ", ".join(f"{_manifold_label(e)} {e['normal_share']:.3f} -> {e['evals_vs_euclidean']:.3f}"
                              for e in res["es_ratio_by_normal_share"]), flush=True)
    if not args.skip_model and "select" in only:
        res.update(select_figures(args.problems or (30 if q else 60), 20))
        print(f"select: evals_vs_full={res['select_evals_vs_full']:.3f} (CLI lookahead/batch "
              f"{res['select_lookahead']}; {res['select_evals_vs_full_no_lookahead']:.3f} counting only answers "
              f"read), winner match "
              f"{res['select_winner_match_rate']:.2f}, full accuracies {res['select_full_accuracy']}", flush=True)
    else:
        res["select_evals_vs_full"] = None
    keys = ["tci_correct_rate", "tci_samples_vs_uniform", "bisection_success_rate", "es_sphere_success_rate",
            "bts_vs_random_regret_ratio", "select_evals_vs_full"]
    extra = ([k for k in ("es_sphere_success_rate_euclidean", "es_sphere_success_rate_cma",
                          "es_sphere_evals_vs_euclidean", "es_sphere_evals_vs_cma", "es_stiefel_success_rate",
                          "es_stiefel_success_rate_euclidean", "es_stiefel_evals_vs_euclidean", "select_lookahead",
                          "select_evals_vs_full_no_lookahead", "select_winner_match_rate") if k in res])
    if args.only:
        print(json.dumps({k: res.get(k) for k in keys + extra}))
        return
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("select_quick.json" if q else "select.json")
    path.write_text(json.dumps(res, indent=2, default=float))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pkeys = ["tci_samples_vs_uniform", "bisection_success_rate", "es_sphere_success_rate",
                 "es_sphere_evals_vs_euclidean", "es_stiefel_evals_vs_euclidean", "bts_vs_random_regret_ratio",
                 "select_evals_vs_full"]
        vals = [res.get(k) or 0.0 for k in pkeys]
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
        sweep = res["es_ratio_by_normal_share"]
        ax2.plot([e["normal_share"] for e in sweep], [e["evals_vs_euclidean"] for e in sweep], "o-")
        for e in sweep:
            ax2.annotate(_manifold_label(e),
                         (e["normal_share"], e["evals_vs_euclidean"]), fontsize=7)
        ax2.axhline(1.0, color="k", lw=0.8, ls="--")
        ax2.set_xlabel("share of ambient directions normal to M (1 - d/n)", fontsize=8)
        ax2.set_ylabel("median evals to overlap 0.95:\nRiemannian / ambient ES", fontsize=8)
        ax2.set_title("sparse PCA: where the manifold ES is ahead", fontsize=9)
        ax.bar(range(len(pkeys)), vals)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(pkeys)), [k.replace("_", "\n") for k in pkeys], fontsize=7)
        ax.set_title("select bench: ratios vs baselines (< 1 better) and success rates")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=100)
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}", file=sys.stderr)
    print(json.dumps({k: res.get(k) for k in keys + extra}))


if __name__ == "__main__":
    main()
