"""Statistics for comparing VSPO with its baselines over seeds (used by ``bench/vspo.py``).

Each run's ``eval.json`` (``llmkit.train.vspo.recipe``) holds an ``after`` evaluation (``n`` problems, behaviour
rate, accuracy) and, with a curve, ``first_step_at_target``. Per method this module pools the seeds' graded
problems into one proportion with a Wilson 95% interval (``scipy.stats.binomtest``), keeps the per-seed values
and their spread, and treats a seed that never reached the target behaviour rate as right-censored at
``max_steps`` (Kaplan-Meier median via ``llmkit.train.vspo.bandit.km_median``; None = not reached).
"""

from __future__ import annotations

from statistics import mean, stdev


def wilson(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    from scipy.stats import binomtest

    if n <= 0:
        raise ValueError("a proportion needs n >= 1 trials")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def pooled(evals: list[dict], key: str) -> dict:
    """``key`` (behavior_rate or accuracy) pooled over the seeds' evaluations: rate, Wilson CI, per-seed values."""
    if not evals:
        raise ValueError("no evaluations to pool")
    per_seed = [float(e[key]) for e in evals]
    k = sum(round(float(e[key]) * e["n"]) for e in evals)
    n = sum(int(e["n"]) for e in evals)
    lo, hi = wilson(k, n)
    return {"rate": k / n, "ci95": [lo, hi], "k": k, "n": n, "per_seed": per_seed,
            "seed_sd": stdev(per_seed) if len(per_seed) > 1 else None}


def first_steps(runs: list[dict], max_steps: int) -> dict:
    """First step at the target behaviour rate over seeds: values (None = censored at max_steps), reached count and
    the Kaplan-Meier median (None when fewer than half the seeds reached it)."""
    from llmkit.train.vspo.bandit import km_median

    steps = [r.get("first_step_at_target") for r in runs]
    done = [s for s in steps if s is not None]
    return {"per_seed": steps, "reached": len(done), "runs": len(steps), "km_median": km_median(steps, max_steps),
            "mean_reached": mean(done) if done else None, "cap": max_steps}


def summarize(runs_by_method: dict[str, list[dict]], max_steps: int) -> dict:
    """``{method: {"behavior_rate": pooled, "accuracy": pooled, "first_step": first_steps, "seeds": n}}``."""
    out = {}
    for method, runs in runs_by_method.items():
        evals = [r["after"] for r in runs if r.get("after")]
        if not evals:
            continue
        out[method] = {"behavior_rate": pooled(evals, "behavior_rate"), "accuracy": pooled(evals, "accuracy"),
                       "mean_words": mean(e["mean_words"] for e in evals), "seeds": len(evals),
                       "first_step": first_steps(runs, max_steps)}
    return out
