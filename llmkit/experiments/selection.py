"""Few-evaluation selection and tuning (bench/select.py): the four optimization backends in their papers'
settings (top-two best-arm identification, noisy bisection, Riemannian ES, batched Thompson sampling), each
beside its baseline, and ``llmkit select``'s top-two rule replayed over a full evaluation of the bundled model.
Results: bench/results/select*.md.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np


def bandit_figures(seeds: int) -> dict:
    """beta-EB-TCI (top-two) against uniform allocation with the same GLR stopping rule on a Bernoulli instance,
    and its stopping time against T*_beta(mu) log(1/delta) as delta shrinks."""
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
    """``localize_minimizer`` within eps on four noisy convex functions: success rate and mean evaluations."""
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


def es_figures(seeds: int, sphere: dict = ES_SPHERE, stiefel: dict = ES_STIEFEL, sweep_sizes=ES_SWEEP) -> dict:
    """Riemannian (1+1)-ES against the ambient ES projected back (and CMA-ES on the sphere) on sparse PCA; the
    Riemannian / ambient ratio against the share of ambient directions normal to the manifold."""
    from llmkit.optim.es import ES_METHODS, compare_on_sparse_pca, intrinsic_dim, summarize_evaluations

    out = {"es_setting": {"sphere": sphere, "stiefel": stiefel, "seeds": seeds,
                          "success": "best point so far reaches overlap >= target within the budget",
                          "evals": "median [q1, q3] evaluations to success, a miss counted as budget + 1"}}
    for name, cfg, methods in (("sphere", sphere, ES_METHODS), ("stiefel", stiefel, ("riemannian", "euclidean"))):
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
    sweep = [(sphere["n"], 1, None, out["es_sphere_evals_vs_euclidean"]),
             (stiefel["n"], stiefel["p"], None, out["es_stiefel_evals_vs_euclidean"])]
    for n, p, budget in sweep_sizes:
        runs = compare_on_sparse_pca(n, p=p, seeds=seeds, budget=budget, methods=("riemannian", "euclidean"))
        med = {m: summarize_evaluations(r["evals"], budget)["median"] for m, r in runs.items()}
        sweep.append((n, p, budget, med["riemannian"] / med["euclidean"]))
    out["es_ratio_by_normal_share"] = sorted(
        ({"n": n, "p": p, "budget": b, "normal_share": 1 - intrinsic_dim((n, p) if p > 1 else (n,),
                                                                          "stiefel" if p > 1 else "sphere") / (n * p),
          "evals_vs_euclidean": r} for n, p, b, r in sweep), key=lambda e: e["normal_share"])
    return out


def manifold_label(e: dict) -> str:
    return f"S^{e['n'] - 1}" if e["p"] == 1 else f"St({e['n']},{e['p']})"


def bo_figures(seeds: int, budget: int = 32) -> dict:
    """GP batched Thompson sampling (batches of 4) against random search at equal evaluations: median simple
    regret ratio on Branin and Hartmann-3 (geometric mean of the two)."""
    import torch

    from llmkit.optim.bo import TEST_FUNCTIONS, BatchedThompsonSampling, random_search, run_ask_tell

    torch.set_num_threads(1)
    ratios = {}
    for name in ("branin", "hartmann3"):
        f, b, fmin = TEST_FUNCTIONS[name]
        bts = [run_ask_tell(BatchedThompsonSampling(b, 4, seed=s), f, budget)[1] - fmin for s in range(seeds)]
        rs = [random_search(f, b, budget, seed=s)[1] - fmin for s in range(seeds)]
        ratios[name] = float(np.median(bts) / np.median(rs))
    return {"bts_vs_random_regret_ratio": float(np.exp(np.mean(np.log(list(ratios.values()))))),
            "bts_vs_random_by_function": ratios}


SETTINGS = [  # three generation settings of the bundled model that should differ in accuracy
    {"name": "step-by-step greedy, 64 tokens", "max_new_tokens": 64},
    {"name": "number-only sampled T=1.5", "system_prompt": "Reply with only the final number.",
     "max_new_tokens": 12, "temperature": 1.5, "seed": 1},
    {"name": "2-token budget", "max_new_tokens": 2},
]


def cli_batch_size(register) -> int:
    """``llmkit select``'s default --batch-size (its lookahead), read from the parser itself."""
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return int(ap.parse_args(["select"]).batch_size)


def answer_table(arms, problems: list[dict], engine_factory) -> np.ndarray:
    """The full evaluation: every arm's graded answer (GSM8K grader) to every problem, arms x problems."""
    from llmkit.evals import get_task
    from llmkit.selection import EngineScorer

    n = len(problems)
    scorer = EngineScorer(arms, problems, get_task("gsm8k"), engine_factory, lookahead=n)
    try:
        return np.array([[scorer.score(a, i, list(range(n))) for i in range(n)] for a in range(len(arms))])
    finally:
        scorer.close()


def replay_selection(table: np.ndarray, lookahead: int, seeds: int, delta: float = 0.05) -> dict:
    """The top-two rule over ``seeds`` seeds reading ``table`` through ``TableScorer`` (a miss generates that
    problem and the arm's next upcoming ones, ``lookahead`` at most, all counted as spent), and again counting
    only the answers it read. ``select_*`` figures against the full evaluation's winner."""
    from llmkit.selection import TableScorer, select_best

    n_arms, n_problems = table.shape
    full_winner = int(np.argmax(table.mean(1)))
    runs, bare = [], []
    for s in range(seeds):
        sc = TableScorer(table, lookahead=lookahead)  # the CLI's lookahead batching and cost accounting
        runs.append(select_best(sc.score, n_arms, n_problems, delta=delta, seed=s,
                                generated=lambda sc=sc: len(sc.cache)))
        bare.append(select_best(lambda a, i, *_: float(table[a, i]), n_arms, n_problems, delta=delta, seed=s))
    return {"select_evals_vs_full": float(np.mean([r["evals_vs_full"] for r in runs])),
            "select_lookahead": lookahead,
            "select_evals_vs_full_no_lookahead": float(np.mean([r["evals_vs_full"] for r in bare])),
            "select_winner_match_rate": float(np.mean([r["winner"] == full_winner for r in runs])),
            "select_stopped_rate": float(np.mean([r["stopped"] for r in runs])), "select_example_run": runs[0]}


def select_figures(gsm8k_train: str | Path, n_problems: int, seeds: int, engine_factory=None) -> dict:
    """``llmkit select``'s rule over :data:`SETTINGS` of the bundled model on a GSM8K-derived one-step arithmetic
    subset (the LDPCache bench's construction, on which the model is not at 0%): the answer table is generated
    once, then :func:`replay_selection` with the CLI's default lookahead."""
    from llmkit.commands.select import register
    from llmkit.engines import get_engine
    from llmkit.experiments.ldp_cache.workload import load_arith_problems
    from llmkit.selection import arms_from_config

    problems = [{"question": p["question"], "answer": f"#### {p['gold']}"}
                for p in load_arith_problems(Path(gsm8k_train), n_problems, seed=0)]
    arms = arms_from_config(SETTINGS)
    t0 = time.time()
    table = answer_table(arms, problems, engine_factory or (lambda m: get_engine("hf", m, batch_size=16)))
    res = replay_selection(table, cli_batch_size(register), seeds)
    example = res.pop("select_example_run")
    return {**res, "select_full_accuracy": {a.name: float(v) for a, v in zip(arms, table.mean(1))},
            "select_problems": n_problems, "select_generation_s": round(time.time() - t0, 1),
            "select_example_run": example}


PARTS = {"bandits": (bandit_figures, 20, 100, "tci"), "bisection": (bisection_figures, 6, 25, "bisection"),
         "es": (es_figures, 8, 20, "es"), "bo": (bo_figures, 4, 8, "bts")}  # fn, quick seeds, full seeds, prefix
SUMMARY_KEYS = ("tci_correct_rate", "tci_samples_vs_uniform", "bisection_success_rate", "es_sphere_success_rate",
                "bts_vs_random_regret_ratio", "select_evals_vs_full")
EXTRA_KEYS = ("es_sphere_success_rate_euclidean", "es_sphere_success_rate_cma", "es_sphere_evals_vs_euclidean",
              "es_sphere_evals_vs_cma", "es_stiefel_success_rate", "es_stiefel_success_rate_euclidean",
              "es_stiefel_evals_vs_euclidean", "select_lookahead", "select_evals_vs_full_no_lookahead",
              "select_winner_match_rate")


def run_parts(only: set[str], quick: bool) -> dict:
    """The backends' figures for the parts in ``only`` (of :data:`PARTS`), one printed line each."""
    res: dict = {}
    for name, (fn, quick_seeds, seeds, prefix) in PARTS.items():
        if name not in only:
            continue
        t0 = time.time()
        res.update(fn(quick_seeds if quick else seeds))
        print(f"{name}: " + ", ".join(f"{k}={v:.3f}" for k, v in res.items() if isinstance(v, float)
                                      and k.startswith(prefix)) + f" ({time.time() - t0:.0f}s)", flush=True)
        if name == "es":
            print("es_ratio_by_normal_share (1 - d/n -> median evals Riemannian / ambient ES): "
                  + ", ".join(f"{manifold_label(e)} {e['normal_share']:.3f} -> {e['evals_vs_euclidean']:.3f}"
                              for e in res["es_ratio_by_normal_share"]), flush=True)
    return res


def summary(res: dict) -> dict:
    """The last stdout line: the headline figures, then those extra ones the run produced."""
    return {k: res.get(k) for k in SUMMARY_KEYS} | {k: res[k] for k in EXTRA_KEYS if k in res}


def plot(res: dict, path: Path) -> None:
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
        ax2.annotate(manifold_label(e), (e["normal_share"], e["evals_vs_euclidean"]), fontsize=7)
    ax2.axhline(1.0, color="k", lw=0.8, ls="--")
    ax2.set_xlabel("share of ambient directions normal to M (1 - d/n)", fontsize=8)
    ax2.set_ylabel("median evals to overlap 0.95:\nRiemannian / ambient ES", fontsize=8)
    ax2.set_title("sparse PCA: where the manifold ES is ahead", fontsize=9)
    ax.bar(range(len(pkeys)), vals)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(pkeys)), [k.replace("_", "\n") for k in pkeys], fontsize=7)
    ax.set_title("select bench: ratios vs baselines (< 1 better) and success rates")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
