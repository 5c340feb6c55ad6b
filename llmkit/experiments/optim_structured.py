"""Structured optimization (bench/optim_structured.py): LOCU, TC-DRO, noiseless inverse optimization, rank-one
tensor recovery on the Segre manifold and matrix completion by nullspace perturbation, each beside its anchor
(a reward penalty, ERM / global chi-square DRO, the d/T rate, RGD, the perturbation size eps), plus LOCU as
VSPO's length constraint on the bundled model. Results: bench/results/optim_structured*.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from llmkit.optim import constrained, dro, inverse, matrix, tensor
from llmkit.rewards import preferences


def locu_figures(seeds: int, steps: int = 150) -> dict:
    """LOCU on the softmax CMDP toy from infeasible starts beside fixed reward penalties, and step lengths from
    near-collinear constraints (LOCU vs naive projection)."""
    out = {"locu": [], "penalty_1": [], "penalty_2": []}
    rewards = {k: [] for k in out}
    for seed in range(seeds):
        for key, method, pen in (("locu", "locu", 0), ("penalty_1", "penalty", 1.0), ("penalty_2", "penalty", 2.0)):
            _, values, rew = constrained.run_softmax_cmdp(seed, method, steps=steps, trust_radius=0.05, penalty=pen)
            out[key].append(bool(values[-1].max() <= 1e-3))
            rewards[key].append(float(rew[-1]))
    # near-collinear constraints: step length over the trust radius
    ratios_locu, ratios_naive = [], []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        r = torch.randn(30, generator=g, dtype=torch.float64)
        b = r + torch.randn(30, generator=g, dtype=torch.float64)
        B = torch.stack([b + 1e-8 * torch.randn(30, generator=g, dtype=torch.float64) for _ in range(4)])
        c = torch.tensor([0.3, 0.31, 0.29, 0.3], dtype=torch.float64)
        ratios_locu.append(float(constrained.locu_step(r, B, c, None, 0.5).norm()) / 0.5)
        ratios_naive.append(float(constrained.naive_projection_step(r, B, c, None, 0.5).norm()) / 0.5)
    return {"locu_feasible_rate": float(np.mean(out["locu"])),
            "penalty1_feasible_rate": float(np.mean(out["penalty_1"])),
            "penalty2_feasible_rate": float(np.mean(out["penalty_2"])),
            "locu_final_reward": float(np.mean(rewards["locu"])),
            "penalty1_final_reward": float(np.mean(rewards["penalty_1"])),
            "penalty2_final_reward": float(np.mean(rewards["penalty_2"])),
            "collinear_step_over_radius_locu_max": float(np.max(ratios_locu)),
            "collinear_step_over_radius_naive_median": float(np.median(ratios_naive))}


def _tail_mse(beta, X, y, mask):
    return float(np.mean(((beta[0] + X @ beta[1:]) - y)[mask] ** 2))


def _dro_compare(X, y, Xt, yt, radius, regions):
    tail = dro.tail_mask(y, yt, 0.1)
    fits = {"erm": dro.fit_weighted_linear(X, y),
            "chi2": dro.fit_weighted_linear(X, y, lambda t, l: dro.chi2_dro_weights(l, radius)),
            "tc_dro": dro.fit_weighted_linear(X, y, lambda t, l: dro.tc_dro_weights(t, l, regions, radius)),
            "wasserstein": dro.wasserstein_dro_linear(X, y, radius)}
    return {k: _tail_mse(b, Xt, yt, tail) for k, b in fits.items()}


def dro_figures(quick: bool, gsm8k: str | Path | None = None, toy_seeds: int | None = None,
                toy_n: tuple[int, int] = (3000, 20000), folds: int = 5) -> dict:
    """TC-DRO vs ERM, global chi-square and Wasserstein DRO: tail MSE on the imbalanced toy, on scikit-learn's
    diabetes data (``folds``-fold) and, with ``gsm8k`` (a folder with train/test.jsonl), in the difficulty regressor."""
    toy = []
    for seed in range(toy_seeds or (3 if quick else 10)):
        X, y = dro.imbalanced_regression_toy(toy_n[0], seed=seed)
        Xt, yt = dro.imbalanced_regression_toy(toy_n[1], seed=100 + seed)
        toy.append(_dro_compare(X, y, Xt, yt, 0.1, 10))
    res = {f"toy_tail_mse_{k}": float(np.mean([t[k] for t in toy])) for k in toy[0]}
    # scikit-learn's bundled diabetes data: cross-validated tail MSE
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import KFold

    Xd, yd = load_diabetes(return_X_y=True)
    folds = [_dro_compare(Xd[a], yd[a], Xd[b], yd[b], 0.1, 10)
             for a, b in KFold(folds, shuffle=True, random_state=0).split(Xd)]
    res.update({f"diabetes_tail_mse_{k}": float(np.mean([f[k] for f in folds])) for k in folds[0]})
    # the llmkit use: GSM8K difficulty regressor (solution steps from the question)
    data = Path(gsm8k) if gsm8k else None
    if data is not None and (data / "train.jsonl").exists():
        from llmkit.train.common import load_records
        from llmkit.train.difficulty import DifficultyRegressor, solution_steps

        train = load_records(str(data / "train.jsonl"))[: 2000 if quick else None]
        test = load_records(str(data / "test.jsonl"))
        q, s = [r["question"] for r in train], np.array([solution_steps(r["answer"]) for r in train])
        qt, st = [r["question"] for r in test], np.array([solution_steps(r["answer"]) for r in test])
        tail = dro.tail_mask(s, st, 0.1)
        for w in ("erm", "chi2", "tc_dro"):
            pred = DifficultyRegressor(weighting=w, radius=0.1, n_features=64, ridge=1e-2).fit(q, s).predict(qt)
            res[f"gsm8k_difficulty_tail_mse_{w}"] = float(np.mean((pred - st)[tail] ** 2))
            res[f"gsm8k_difficulty_mse_{w}"] = float(np.mean((pred - st) ** 2))
    return res


def io_figures(quick: bool, Ts: list[int] | None = None, reps: int | None = None, n_test: int = 2000) -> dict:
    """Noiseless inverse optimization: held-out decision error against the number of demonstrations T (needs
    T = 400 among ``Ts``), and reward weights recovered from simulated preference pairs."""
    d, k = 5, 10
    Ts = Ts or [25, 50, 100, 200, 400] + ([] if quick else [800, 1600])
    reps = reps or (5 if quick else 20)
    errs = {}
    for T in Ts:
        e = []
        for rep in range(reps):
            rng = np.random.default_rng(10_000 * T + rep)
            theta = rng.normal(size=d)
            feas = [rng.normal(size=(k, d)) for _ in range(T)]
            acts = [int(np.argmax(f @ theta)) for f in feas]
            test = [rng.normal(size=(k, d)) for _ in range(n_test)]
            e.append(inverse.decision_error(inverse.fit_objective(None, acts, feas), theta, test))
        errs[T] = float(np.mean(e))
    slope = float(np.polyfit(np.log(Ts), np.log([errs[T] for T in Ts]), 1)[0])
    planted = np.array([2.0, 0.5, 1.0, 0.2])
    p, r = preferences.simulate_preference_pairs(planted, 400, seed=0, binary=(0, 1))
    w = np.asarray(preferences.infer_reward_weights(p, r))
    tp, tr = preferences.simulate_preference_pairs(planted, 5000, seed=1, binary=(0, 1))
    keep = np.abs((tp - tr) @ planted) > 1e-9
    return {"io_errors_by_T": errs, "io_heldout_error": errs[400], "io_T_times_error_over_d_at_400": 400 * errs[400] / d,
            "io_log_slope": slope, "pref_weights": w.tolist(),
            "pref_cosine": float(w @ planted / np.linalg.norm(w) / np.linalg.norm(planted)),
            "pref_heldout_agreement": preferences.pairwise_agreement(w, tp[keep], tr[keep]),
            "pref_uniform_agreement": preferences.pairwise_agreement(np.ones(4), tp[keep], tr[keep])}


def tensor_figures(seeds: int) -> dict:
    """Rank-one tensor recovery on the Segre manifold: iterations to the noise floor, RGN / RGD."""
    shape, m, sigma = (8, 8, 8), 150, 1e-4
    ratios, curves = [], {}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        us = [torch.randn(n, generator=g, dtype=torch.float64) for n in shape]
        X = tensor.compose(1.0, [u / u.norm() for u in us])
        A = torch.randn(m, *shape, generator=g, dtype=torch.float64)
        y = A.reshape(m, -1) @ X.reshape(-1) + sigma * torch.randn(m, generator=g, dtype=torch.float64)
        errs = {}
        for method, iters in (("rgn", 10), ("rgd", 200)):
            e: list[float] = []
            tensor.recover_rank_one(A, y, shape, method, iters=iters,
                                    callback=lambda it, Z, e=e, X=X: e.append(float((Z - X).norm())))
            errs[method] = e
        level = 1.5 * min(errs["rgn"][-1], errs["rgd"][-1])
        # a run that never gets there counts as its iteration budget + 1 (censored)
        first = {k: next((i for i, v in enumerate(e) if v <= level), len(e)) for k, e in errs.items()}
        ratios.append(first["rgn"] / first["rgd"])
        if seed == 0:
            curves = {k: v[:81] for k, v in errs.items()}
    return {"rgn_vs_rgd_iters_ratio": float(np.mean(ratios)), "tensor_error_curves_seed0": curves}


def mc_figures(seeds: int) -> dict:
    """Matrix completion by nullspace perturbation: relative error for three perturbation sizes eps."""
    out = {}
    for eps in (1e-1, 1e-2, 1e-3):
        e = []
        for seed in range(seeds):
            truth, mask = matrix.low_rank_problem(60, 60, 3, 0.25, seed=seed)
            e.append(matrix.relative_error(matrix.complete(truth, mask, 3, eps), truth))
        out[f"mc_relative_error_eps{eps:g}"] = float(np.mean(e))
    out["mc_relative_error"] = out["mc_relative_error_eps0.001"]
    return out


def _vspo_run(config: str | Path, out: Path, extra: list[str]) -> list[dict]:
    from llmkit.cli import main as llmkit_main

    rc = llmkit_main(["train", "vspo", "--config", str(config), "--output_dir", str(out), *extra])
    if rc != 0:
        raise RuntimeError(f"llmkit train vspo exited with {rc}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "vspo/mean_words" in r]


def locu_vspo_figures(config: str | Path, quick: bool, steps: int | None = None,
                      max_completion_length: int | None = None, max_words: float = 20.0,
                      trust_radius: float = 0.05) -> dict:
    """Bundled-model VSPO with the limit "mean completion words <= max_words": LOCU (``reward_aggregation locu``,
    the task reward as objective) beside the reward-penalty version (``sum`` aggregation; the verbosity reward with
    the band [1, max_words] is the length penalty: 1 up to the limit, falling to 0 at twice it; a negative weight
    on a band reward would punish being inside the band, so the band is used instead). Same seed, rollouts,
    steering and step budget: optim sgd at lr 1 with gradient clipping at the trust radius, so the penalty run's
    step is its gradient clipped to the same radius that bounds LOCU's. Per method: mean words per step,
    constraint satisfaction rate (fraction of steps whose rollouts have mean words <= the limit), final task
    reward (mean gsm8k_correctness over the last half of the steps). ``config``: the VSPO recipe YAML."""
    import tempfile

    steps = steps or (4 if quick else 12)
    max_completion_length = max_completion_length or (48 if quick else 96)
    common = ["--max_steps", str(steps), "--max_completion_length", str(max_completion_length),
              "--per_device_train_batch_size", "4", "--num_generations", "4", "--dataset_limit", str(4 * steps),
              "--eval_path", "", "--steering_num_pairs", "8", "--save_strategy", "no", "--disable_tqdm", "true",
              "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant", "--weight_decay", "0",
              "--max_grad_norm", str(trust_radius), "--verbosity_min_words", "1",
              "--verbosity_max_words", str(int(max_words)), "--seed", "0"]
    methods = {"locu": ["--reward_aggregation", "locu", "--locu_max_words", str(max_words),
                        "--locu_trust_radius", str(trust_radius), "--behavior_weight", "0"],
               "penalty": ["--reward_aggregation", "sum", "--behavior_weight", "1.0"]}
    res: dict = {"vspo_locu_max_words": max_words, "vspo_locu_trust_radius": trust_radius, "vspo_locu_steps": steps,
                 "vspo_locu_max_completion_length": max_completion_length}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-vspo-locu-") as tmp:
        for name, extra in methods.items():
            recs = _vspo_run(config, Path(tmp) / name, common + extra)
            words = [float(r["vspo/mean_words"]) for r in recs]
            task = [float(r.get("rewards/gsm8k_correctness/mean", float("nan"))) for r in recs]
            tail = task[len(task) // 2:] or task
            res[f"vspo_{name}_mean_words_per_step"] = words
            res[f"vspo_{name}_constraint_satisfaction"] = float(np.mean([w <= max_words for w in words]))
            res[f"vspo_{name}_final_task_reward"] = float(np.nanmean(tail)) if tail else float("nan")
            res[f"vspo_{name}_final_mean_words"] = words[-1] if words else float("nan")
            if name == "locu":
                res["vspo_locu_step_norm_max"] = max(float(r.get("locu/step_norm", 0.0)) for r in recs)
                res["vspo_locu_active_rate"] = float(np.mean([float(r.get("locu/active", 0.0)) for r in recs]))
    res["vspo_locu_seconds"] = time.time() - t0
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    Ts = sorted(int(t) for t in res["io_errors_by_T"])
    e = [res["io_errors_by_T"][t] for t in Ts]
    ax[0].loglog(Ts, e, "o-", label="fit_objective")
    ax[0].loglog(Ts, [e[0] * Ts[0] / t for t in Ts], "k--", label="d/T slope")
    ax[0].set(xlabel="demonstrations T", ylabel="held-out decision error", title="Inverse optimization (d=5)")
    ax[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax[0].set_xticks(Ts, [str(t) for t in Ts])
    ax[0].legend()
    for k, v in res["tensor_error_curves_seed0"].items():
        ax[1].semilogy(v, label=k.upper())
    ax[1].set(xlabel="iteration", ylabel="||X_t - X||", title="Rank-one recovery (Segre)")
    ax[1].legend()
    groups = ["toy", "diabetes", "gsm8k_difficulty"]
    methods = ["erm", "chi2", "tc_dro"]
    for i, mth in enumerate(methods):
        vals = [res.get(f"{g}_tail_mse_{mth}", np.nan) / res.get(f"{g}_tail_mse_erm", np.nan) for g in groups]
        ax[2].bar(np.arange(3) + 0.25 * i, vals, 0.25, label=mth)
    ax[2].set_xticks(np.arange(3) + 0.25, groups)
    ax[2].set(ylabel="tail MSE / ERM", title="TC-DRO")
    ax[2].legend()
    eps = [0.1, 0.01, 0.001]
    ax[3].loglog(eps, [res[f"mc_relative_error_eps{x:g}"] for x in eps], "o-", label="complete()")
    ax[3].loglog(eps, eps, "k--", label="eps")
    ax[3].set(xlabel="eps", ylabel="relative error", title="Matrix completion (25% observed)")
    ax[3].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)




SUMMARY_KEYS = ("locu_feasible_rate", "tc_dro_tail_mse_ratio_vs_erm", "io_heldout_error", "rgn_vs_rgd_iters_ratio",
                "mc_relative_error", "toy_tests_passed", "toy_tests_total", "penalty1_feasible_rate",
                "tc_dro_tail_mse_ratio_vs_chi2", "io_log_slope", "pref_cosine", "vspo_locu_length_constraint",
                "vspo_locu_constraint_satisfaction", "vspo_penalty_constraint_satisfaction",
                "vspo_locu_final_task_reward", "vspo_penalty_final_task_reward")


def figures(quick: bool, gsm8k: str | Path | None, vspo_config: str | Path | None) -> dict:
    """Every figure of bench/optim_structured.py but the test count, printed as it comes. ``gsm8k``: a folder
    with train/test.jsonl (the difficulty regressor); ``vspo_config``: the VSPO recipe YAML (None: that part
    is recorded as skipped). A failed VSPO run is recorded, not raised: it must not lose the other figures."""
    seeds = 5 if quick else 20
    res = {"quick": quick}
    res.update(locu_figures(seeds))
    print(f"LOCU feasible at the end (CMDP toy, {seeds} seeds): {res['locu_feasible_rate']:.2f}; "
          f"reward penalty 1: {res['penalty1_feasible_rate']:.2f}, penalty 2: {res['penalty2_feasible_rate']:.2f}")
    print(f"LOCU final reward {res['locu_final_reward']:.3f}; penalty 1 {res['penalty1_final_reward']:.3f}, "
          f"penalty 2 {res['penalty2_final_reward']:.3f}")
    print(f"near-collinear constraints, step / trust radius: LOCU max {res['collinear_step_over_radius_locu_max']:.3f}, "
          f"naive projection median {res['collinear_step_over_radius_naive_median']:.3g}")
    res.update(dro_figures(quick, gsm8k))
    for g in ("toy", "diabetes", "gsm8k_difficulty"):
        if f"{g}_tail_mse_erm" in res:
            erm = res[f"{g}_tail_mse_erm"]
            print(f"TC-DRO {g}: tail MSE ratio vs ERM {res[f'{g}_tail_mse_tc_dro'] / erm:.3f}, "
                  f"vs chi2 {res[f'{g}_tail_mse_tc_dro'] / res[f'{g}_tail_mse_chi2']:.3f} "
                  f"(chi2 vs ERM {res[f'{g}_tail_mse_chi2'] / erm:.3f})")
    res["tc_dro_tail_mse_ratio_vs_erm"] = res["toy_tail_mse_tc_dro"] / res["toy_tail_mse_erm"]
    res["tc_dro_tail_mse_ratio_vs_chi2"] = res["toy_tail_mse_tc_dro"] / res["toy_tail_mse_chi2"]
    res["wasserstein_tail_mse_ratio_vs_erm"] = res["toy_tail_mse_wasserstein"] / res["toy_tail_mse_erm"]
    print(f"Wasserstein DRO (norm penalty) toy tail MSE ratio vs ERM: {res['wasserstein_tail_mse_ratio_vs_erm']:.3f}")
    res.update(io_figures(quick))
    print(f"inverse optimization held-out error at T=400, d=5: {res['io_heldout_error']:.4f} "
          f"(T*err/d = {res['io_T_times_error_over_d_at_400']:.2f}); log-log slope over T: {res['io_log_slope']:.2f}")
    print(f"reward weights from 400 preference pairs: cosine with planted {res['pref_cosine']:.4f}; held-out agreement "
          f"{res['pref_heldout_agreement']:.3f} vs uniform weights {res['pref_uniform_agreement']:.3f}")
    res.update(tensor_figures(3 if quick else 10))
    print(f"iterations to the noise floor, RGN / RGD: {res['rgn_vs_rgd_iters_ratio']:.3f}")
    res.update(mc_figures(2 if quick else 5))
    print("matrix completion relative error (60x60 rank 3, 25% observed): "
          + ", ".join(f"eps {e:g}: {res[f'mc_relative_error_eps{e:g}']:.2e}" for e in (0.1, 0.01, 0.001)))
    if vspo_config is None:
        res["vspo_locu_length_constraint"] = "skipped"
        return res
    try:
        res.update(locu_vspo_figures(vspo_config, quick))
        res["vspo_locu_length_constraint"] = "ran"
        L = res["vspo_locu_max_words"]
        for m in ("locu", "penalty"):
            print(f"VSPO bundled model, mean words <= {L:g} ({m}): satisfied on "
                  f"{res[f'vspo_{m}_constraint_satisfaction']:.2f} of {res['vspo_locu_steps']} steps, mean words per "
                  f"step {[round(w, 1) for w in res[f'vspo_{m}_mean_words_per_step']]}, final task reward "
                  f"{res[f'vspo_{m}_final_task_reward']:.3f}")
        print(f"VSPO LOCU max step norm {res['vspo_locu_step_norm_max']:.4f} (trust radius "
              f"{res['vspo_locu_trust_radius']:g}), constraint active on {res['vspo_locu_active_rate']:.2f} of steps")
    except Exception as exc:  # noqa: BLE001 -- a missing bundled model or a failed run must not lose the figures
        res["vspo_locu_length_constraint"] = f"failed: {type(exc).__name__}: {exc}"
        print(f"VSPO with a LOCU length constraint: {res['vspo_locu_length_constraint']}")
    return res
