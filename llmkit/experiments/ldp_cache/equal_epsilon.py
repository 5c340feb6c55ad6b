"""The LDPCache bench's main run at equal epsilon per token: every LLM call up front (the no-cache arm and
one plain ask per problem), then every arm scored on those answers, the hit-ratio sweep, the printed
lines, the figure keys of the last-line JSON, the result file and its plot.

Pipeline: the bundled model is served by ``llmkit serve`` (a subprocess through
``llmkit.experiments.harness.ServeProcess``; hf engine with one thread, or vLLM's engine, much faster on
CPU) unless an upstream URL is given. Every query sent upstream is perturbed by the token exponential
mechanism (epsilon per word piece, so a query costs epsilon x its length). The no-cache arm sends every
query; LDPCache sends only its misses, and a hit costs the randomized-response bit. Answers can be kept in
a JSONL file, so a long run split over several invocations resumes without asking again, and a complete
file replays a run without a model (a missing answer then fails loudly).

Accuracy: the last number of an answer equals the GSM8K answer. The bundled model is weak on open-ended
GSM8K, so *agreement with the no-privacy answer* is reported too: the share of queries whose answer ends
in the same number as the model's plain, unperturbed answer to the same problem (how much of the
non-private output survives; defined for right and wrong answers alike). Results:
bench/results/ldp_cache.md and bench/results/ldp_cache_arith.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import workload as W
from .runs import MARGIN, MemoUpstream, evaluate_workload, noninferior, pooled_bootstrap, say, served, sweep


@dataclass
class Plan:
    """The sizes of one run, from the bench's flags and the quick/full defaults."""

    quick: bool
    kinds: list[str]
    sizes: dict[str, int]  # distinct problems (uniform) or pool (zipf) per workload kind
    visits: dict[str, int]
    capacity: int
    repeats: int  # scheduler-coin seeds per cache arm
    sweep_seeds: int  # workload seeds in the hit-ratio sweep
    sweep_repeats: int  # scheduler seeds per workload seed in the sweep
    capacities: list[int]  # the sweep's


def make_plan(settings) -> Plan:
    """``settings`` holds the bench's flags (quick, workloads, problems, pool, visits, capacity, repeats,
    sweep_seeds, sweep_repeats, sweep_capacities); ``ValueError`` names an unknown workload."""
    s, q = settings, settings.quick
    kinds = [k.strip() for k in s.workloads.split(",") if k.strip()]
    for k in kinds:
        if k not in W.WORKLOADS:
            raise ValueError(f"unknown workload {k!r} (choose from {', '.join(W.WORKLOADS)})")
    return Plan(
        quick=q,
        kinds=kinds,
        sizes={
            k: (s.pool if k.startswith("zipf") else s.problems) or n
            for k, n in (W.QUICK_SIZES if q else W.FULL_SIZES).items()
        },
        visits={k: s.visits or (W.QUICK_VISITS if q else W.FULL_VISITS[k]) for k in W.WORKLOADS},
        capacity=s.capacity or (3 if q else 8),
        repeats=s.repeats or (5 if q else 20),
        sweep_seeds=s.sweep_seeds or (3 if q else 5),
        sweep_repeats=s.sweep_repeats or (4 if q else 8),
        capacities=[int(c) for c in (s.sweep_capacities or ("2,3,4,6" if q else "2,3,4,6,8,12")).split(",")],
    )


def load_streams(plan: Plan, data: Path, seed: int, max_steps: int) -> tuple[dict, dict]:
    """(problem set, query stream) per workload kind."""
    problem_sets = {
        k: W.load_arith_problems(data, plan.sizes[k], seed)
        if k.endswith("_arith")
        else W.load_problems(data, plan.sizes[k], seed, max_steps)
        for k in plan.kinds
    }
    streams = {k: W.build(k, problem_sets[k], plan.visits[k], seed) for k in plan.kinds}
    return problem_sets, streams


def stream_line(kind: str, queries: list[dict], visits: int) -> str:
    counts = sorted(Counter(x["problem"] for x in queries).values(), reverse=True)
    return (
        f"workload {kind}: {len(queries)} queries, {len(counts)} distinct GSM8K train problems"
        f"{' (one-step arithmetic from their annotations)' if kind.endswith('_arith') else ''} "
        f"(queries per problem {counts}), {visits} visits of 2-4 templated variants"
    )


def ask_all(
    base,
    plain,
    streams: dict,
    problem_sets: dict,
    *,
    seed: int,
    max_tokens: int,
    concurrency: int,
    progress: Callable = lambda it, desc: it,
) -> tuple[dict, dict]:
    """Every LLM call up front, all workloads in one queue (the server batches them).

    ``base`` is the no-cache arm (:class:`llmkit.serving.ldp_cache.PerQueryLDP`): query i of workload k is
    perturbed with the seed ``[seed, WORKLOADS.index(k), i]``. ``plain`` answers each distinct problem
    unperturbed. Returns ``(answers[k][i], plain_text[k][problem])``; on an error or SIGTERM the queued
    calls are dropped.
    """
    jobs = []
    ex = cf.ThreadPoolExecutor(concurrency)
    try:
        for k, qs in streams.items():
            wseed = W.WORKLOADS.index(k)
            for i, x in enumerate(qs):
                jobs.append(
                    (
                        k,
                        "ldp",
                        i,
                        ex.submit(
                            base.ask, x["text"], seed=[seed, wseed, i], max_tokens=max_tokens, temperature=0
                        ),
                    )
                )
            for p in sorted({x["problem"] for x in qs}):
                jobs.append(
                    (
                        k,
                        "plain",
                        p,
                        ex.submit(
                            plain,
                            [{"role": "user", "content": problem_sets[k][p]["question"]}],
                            max_tokens=max_tokens,
                            temperature=0,
                        ),
                    )
                )
        for *_, f in progress(jobs, "LLM calls (memoized ones are instant)"):
            f.result()
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    answers = {k: [f.result() for kk, kind, _, f in jobs if kk == k and kind == "ldp"] for k in streams}
    plain_text = {
        k: {p: f.result() for kk, kind, p, f in jobs if kk == k and kind == "plain"} for k in streams
    }
    return answers, plain_text


def evaluate_all(
    plan: Plan,
    problem_sets: dict,
    streams: dict,
    answers: dict,
    plain_text: dict,
    *,
    mechanism,
    embedder,
    upstream,
    sched,
    seed: int,
    max_tokens: int,
    sim_threshold: float,
    progress: Callable = lambda it, desc: it,
) -> dict:
    """:func:`.runs.evaluate_workload` and the hit-ratio :func:`.runs.sweep` for every workload kind."""
    results = {}
    for k in plan.kinds:
        r = evaluate_workload(
            streams[k],
            problem_sets[k],
            answers[k],
            plain_text[k],
            mechanism=mechanism,
            embedder=embedder,
            upstream=upstream,
            sched=sched,
            capacity=plan.capacity,
            repeats=plan.repeats,
            seed=seed,
            wseed=W.WORKLOADS.index(k),
            max_tokens=max_tokens,
            sim_threshold=sim_threshold,
            progress=lambda it, desc, k=k: progress(it, f"{k}: {desc}"),
        )
        t1 = time.time()
        r["sweep"] = sweep(
            k,
            problem_sets[k],
            plan.visits[k],
            mechanism,
            embedder,
            sched,
            workload_seeds=range(seed, seed + plan.sweep_seeds),
            capacities=plan.capacities,
            repeats=plan.sweep_repeats,
            seed=seed,
        )
        r["sweep_seconds"] = round(time.time() - t1, 1)
        r["pool"] = plan.sizes[k]
        results[k] = r
    return results


def answer_and_evaluate(
    settings,
    plan: Plan,
    problem_sets: dict,
    streams: dict,
    *,
    mechanism,
    embedder,
    sched,
    cwd=None,
    progress: Callable = lambda it, desc: it,
    log: Callable = say,
) -> dict:
    """Serve (or reach ``settings.upstream``), make every LLM call through the answers memo, evaluate every arm.

    ``settings``: upstream, server_engine, model, answers, seed, max_tokens, concurrency, sim_threshold.
    Returns ``{results, model, calls, extra_calls}`` (calls made in this invocation: the no-cache arm's and
    the plain asks, then any later ones, which a correct run never makes).
    """
    from llmkit.serving.ldp_cache import OpenAIUpstream, PerQueryLDP, PrivacyLedger

    s, t0 = settings, time.time()
    if not s.upstream:
        log("starting llmkit serve ...")
    with served(s.upstream, s.server_engine, cwd) as url:
        up = MemoUpstream(OpenAIUpstream(url, model=s.model, timeout=3600.0), s.answers)
        model = up.upstream.model  # asked while the server is up (the first model it lists)
        base = PerQueryLDP(up, PrivacyLedger(":memory:", 1e18), mechanism)
        answers, plain_text = ask_all(
            base,
            up,
            streams,
            problem_sets,
            seed=s.seed,
            max_tokens=s.max_tokens,
            concurrency=s.concurrency,
            progress=progress,
        )
        calls = up.calls
        log(f"LLM calls made in this invocation: {calls} ({time.time() - t0:.0f} s)")
        results = evaluate_all(
            plan,
            problem_sets,
            streams,
            answers,
            plain_text,
            mechanism=mechanism,
            embedder=embedder,
            upstream=up,
            sched=sched,
            seed=s.seed,
            max_tokens=s.max_tokens,
            sim_threshold=s.sim_threshold,
            progress=progress,
        )
    return {"results": results, "model": model, "calls": calls, "extra_calls": up.calls - calls}


def header_line(settings, plan: Plan, run: dict) -> str:
    """Where the answers came from and the run's privacy and cache settings."""
    s = settings
    where = f"at {s.upstream}" if s.upstream else f"behind llmkit serve ({s.server_engine} engine)"
    if s.answers is not None and run["calls"] + run["extra_calls"] == 0:
        where = f"(every answer replayed from {s.answers}; no LLM call in this invocation)"
    return (
        f"model: {run['model']} {where}; capacity {plan.capacity}; eps/token {s.epsilon_per_token:g}; rr eps "
        f"{s.rr_epsilon:g}; {s.max_tokens} answer tokens; {plan.repeats} scheduler seeds per cache arm"
    )


def workload_lines(kind: str, r: dict, plan: Plan) -> list[str]:
    """The printed lines of one workload: budget, accuracy, agreement, where accuracy differs, intervals,
    hit ratios and the sweep."""
    arms = r["arms"]
    nc, mf, lru = arms["no_cache"], arms["ldpcache_multifactor"], arms["ldpcache_lru"]
    bs = r["accuracy_diff_vs_no_cache"]
    saving = 1.0 - mf["epsilon_per_query"] / nc["epsilon_per_query"]
    task = "one-step arithmetic from GSM8K" if kind.endswith("_arith") else "GSM8K"
    lines = [
        (
            f"[{kind}] epsilon per answered query: no cache {nc['epsilon_per_query']:.1f}, LDPCache "
            f"{mf['epsilon_per_query']:.1f} -> budget_saving {saving:.3f}"
        ),
        (
            f"[{kind}] accuracy ({task}, same model, same perturbed queries; {r['queries']} queries): no cache "
            f"{nc['accuracy']:.3f}, LDPCache {mf['accuracy']:.3f}, LRU {lru['accuracy']:.3f}; no privacy (plain "
            f"ask per problem) {r['accuracy_plain_queries']:.3f} per query, {r['accuracy_plain_problems']:.3f} "
            f"per problem ({r['problems']} problems)"
        ),
        (
            f"[{kind}] agreement with the no-privacy answer (same final number as the plain ask): no cache "
            f"{nc['agreement']:.3f}, LDPCache {mf['agreement']:.3f}, LRU {lru['agreement']:.3f}"
        ),
        (
            f"[{kind}] where accuracy differs (only hits can differ; mean over scheduler seeds): LDPCache hits "
            f"{mf['hits']:.1f} of {r['queries']}, correct {mf['hits_correct']:.1f} with the cached answer vs "
            f"{mf['hits_correct_no_cache']:.1f} with the no-cache arm's own answer to the same queries; one "
            f"wrong cached answer served up to {mf['max_hits_per_wrong_answer']:.1f} hits"
        ),
        f"[{kind}] accuracy difference vs no cache (95% interval, bootstrap over the "
        f"{bs['ldpcache_lru']['problems']} problems): "
        + "; ".join(
            f"{label} {bs[name]['diff']:+.3f} [{bs[name]['ci95'][0]:+.3f}, {bs[name]['ci95'][1]:+.3f}]"
            for label, name in (("LDPCache", "ldpcache_multifactor"), ("LRU", "ldpcache_lru"))
        )
        + f"; LDPCache non-inferior at margin {MARGIN} (lower bound >= -{MARGIN}): "
        + ("yes" if noninferior(bs["ldpcache_multifactor"]["ci95"]) else "no"),
        (
            f"[{kind}] hit ratio at capacity {plan.capacity} ({plan.repeats} scheduler seeds): multi-factor "
            f"{mf['hit_ratio']:.3f} (min {mf['hit_ratio_min']:.3f}, max {mf['hit_ratio_max']:.3f}), LRU "
            f"{lru['hit_ratio']:.3f} (min {lru['hit_ratio_min']:.3f}, max {lru['hit_ratio_max']:.3f}), "
            f"unbounded {arms['ldpcache_unbounded']['hit_ratio']:.3f}, GPTCache threshold (not private) "
            f"{arms['gptcache_threshold']['hit_ratio']:.3f}; false hits {mf['false_hit_rate']:.3f}"
        ),
    ]
    lines += [
        f"[{kind}] sweep capacity {cap} ({c['diff']['n']} runs = {plan.sweep_seeds} workload seeds x "
        f"{plan.sweep_repeats} scheduler seeds): multi-factor {c['multifactor']['mean']:.3f} +- "
        f"{c['multifactor']['std']:.3f}, LRU {c['lru']['mean']:.3f} +- {c['lru']['std']:.3f}; paired diff "
        f"{c['diff']['mean']:+.3f} (se {c['diff']['se']:.3f}), multi-factor higher in "
        f"{c['share_multifactor_higher']:.0%}, equal in {c['share_equal']:.0%}"
        for cap, c in r["sweep"].items()
    ]
    return lines


def figure_suffix(kind: str, kinds: list[str]) -> str:
    """zipf's keys carry no suffix; uniform's do when zipf is in the run; the arithmetic kinds' always do."""
    if kind == "zipf" or (kind == "uniform" and "zipf" not in kinds):
        return ""
    return "_" + kind


def workload_figures(kind: str, r: dict, kinds: list[str]) -> dict:
    """The figure keys of one workload (the bench's last-line JSON)."""
    arms = r["arms"]
    nc, mf, lru = arms["no_cache"], arms["ldpcache_multifactor"], arms["ldpcache_lru"]
    ci95 = r["accuracy_diff_vs_no_cache"]["ldpcache_multifactor"]["ci95"]
    sfx = figure_suffix(kind, kinds)
    f = {
        "budget_saving": round(1.0 - mf["epsilon_per_query"] / nc["epsilon_per_query"], 4),
        "accuracy_cache": round(mf["accuracy"], 4),
        "accuracy_no_cache": round(nc["accuracy"], 4),
        "hit_ratio_multifactor": round(mf["hit_ratio"], 4),
        "hit_ratio_lru": round(lru["hit_ratio"], 4),
        "accuracy_lru": round(lru["accuracy"], 4),
        "agreement_no_cache": round(nc["agreement"], 4),
        "agreement_cache": round(mf["agreement"], 4),
        "agreement_lru": round(lru["agreement"], 4),
        "accuracy_plain_no_privacy": round(r["accuracy_plain_queries"], 4),
        "accuracy_diff_cache_ci95": [round(x, 4) for x in ci95],
        "accuracy_noninferior": noninferior(ci95),
        "accuracy_on_hits_cache": round(mf["hits_correct"] / mf["hits"], 4) if mf["hits"] else None,
        "accuracy_on_hits_no_cache": round(mf["hits_correct_no_cache"] / mf["hits"], 4)
        if mf["hits"]
        else None,
        "budget_saving_lru": round(1.0 - lru["epsilon_per_query"] / nc["epsilon_per_query"], 4),
        "hit_ratio_gptcache_not_private": round(arms["gptcache_threshold"]["hit_ratio"], 4),
        "hit_ratio_unbounded": round(arms["ldpcache_unbounded"]["hit_ratio"], 4),
        "false_hit_rate_cache": round(mf["false_hit_rate"], 4),
        "sweep_hit_ratio_diff_mean": round(
            sum(c["diff"]["mean"] for c in r["sweep"].values()) / len(r["sweep"]), 4
        ),
    }
    return {k + sfx: v for k, v in f.items()}


def pooled_figures(kinds: list[str], streams: dict, results: dict) -> tuple[dict, str]:
    """The workloads' problems together, one interval for the whole run: (figure keys, printed line)."""
    pooled = pooled_bootstrap(
        {
            k: (
                Counter(x["problem"] for x in streams[k]),
                results[k]["arms"]["ldpcache_multifactor"]["correct_per_problem"],
                results[k]["arms"]["no_cache"]["correct_per_problem"],
            )
            for k in kinds
        }
    )
    lo, hi = pooled["ci95"]
    ok = noninferior(pooled["ci95"])
    line = (
        f"[pooled: {', '.join(kinds)}] accuracy difference LDPCache - no cache over "
        f"{sum(len(streams[k]) for k in kinds)} queries, {pooled['problems']} problems: {pooled['diff']:+.3f} "
        f"[{lo:+.3f}, {hi:+.3f}]; non-inferior at margin {MARGIN}: {'yes' if ok else 'no'}"
    )
    return {
        "accuracy_diff_pooled": round(pooled["diff"], 4),
        "accuracy_diff_pooled_ci95": [round(lo, 4), round(hi, 4)],
        "accuracy_noninferior_pooled": ok,
    }, line


def run_figures(plan: Plan, streams: dict, results: dict, log: Callable = say) -> dict:
    """Prints every workload's lines (and the pooled one) and returns the run's figure keys."""
    figures: dict = {}
    for k in plan.kinds:
        for line in workload_lines(k, results[k], plan):
            log(line)
        figures.update(workload_figures(k, results[k], plan.kinds))
    if len(plan.kinds) > 1:
        pooled, line = pooled_figures(plan.kinds, streams, results)
        log(line)
        figures.update(pooled)
    if "zipf" in plan.kinds:
        figures["workload"] = "zipf (unsuffixed keys); uniform keys end in _uniform"
    return figures


def result_stem(kinds: list[str], quick: bool) -> str:
    """ldp_cache, ldp_cache_arith or ldp_cache_mixed, with _quick."""
    arith = [k.endswith("_arith") for k in kinds]
    return (
        "ldp_cache"
        + ("_arith" if all(arith) else "_mixed" if any(arith) else "")
        + ("_quick" if quick else "")
    )


def build_result(
    plan: Plan,
    results: dict,
    figures: dict,
    *,
    model: str,
    max_tokens: int,
    config: dict,
    mechanism: str,
    fixed_budget: dict,
) -> dict:
    """The result file's content (the keys bench/report.py and the results pages read)."""
    return {
        "figures": figures,
        "workloads": results,
        "model": model,
        "capacity": plan.capacity,
        "config": config,
        "visits": {k: plan.visits[k] for k in plan.kinds},
        "max_tokens": max_tokens,
        "repeats": plan.repeats,
        "zipf_s": W.ZIPF_S,
        "sweep": {
            "workload_seeds": plan.sweep_seeds,
            "scheduler_seeds": plan.sweep_repeats,
            "capacities": plan.capacities,
        },
        "mechanism": mechanism,
        "workload_description": (W.__doc__ or "").strip(),
        "fixed_budget": {k: v for k, v in fixed_budget.items() if k != "curves"},
    }


def write_result(result: dict, out_dir: Path, stem: str) -> Path:
    """``<stem>.json`` and its plot ``<stem>.png``; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{stem}.png")
    return path


def plot(result: dict, path: Path) -> None:
    """Per workload: epsilon per answered query, answer quality, hit ratio, and hit ratio vs capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = ["no_cache", "ldpcache_multifactor", "ldpcache_lru", "gptcache_threshold"]
    labels = ["per-query LDP", "LDPCache\nmulti-factor", "LDPCache\nLRU", "GPTCache\n(not private)"]
    kinds = list(result["workloads"])
    fig, axes = plt.subplots(len(kinds), 4, figsize=(16, 3.6 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        w = result["workloads"][kind]
        for ax, key, title in zip(
            row[::2], ["epsilon_per_query", "hit_ratio"], ["epsilon per answered query", "hit ratio"]
        ):
            ax.bar(labels, [w["arms"][a].get(key, 0.0) for a in arms], color=["grey", "C0", "C1", "C2"])
            ax.set_title(f"{kind}: {title}")
            ax.tick_params(axis="x", labelsize=7)
        ax = row[1]
        xs = list(range(len(arms)))
        ax.bar(
            [x - 0.2 for x in xs], [w["arms"][a].get("accuracy", 0.0) for a in arms], 0.4, label="accuracy"
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [w["arms"][a].get("agreement", 0.0) for a in arms],
            0.4,
            label="agrees with no-privacy answer",
        )
        ax.axhline(w["accuracy_plain_queries"], color="k", ls="--", lw=1, label="no-privacy accuracy")
        ax.set_xticks(xs, labels)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{kind}: answer quality")
        ax.set_ylim(
            0, 1.35 * max(0.01, w["accuracy_plain_queries"], *(w["arms"][a].get("accuracy", 0) for a in arms))
        )
        ax.legend(fontsize=7, loc="upper right")
        ax = row[3]
        sw = w.get("sweep", {})
        caps = sorted(int(c) for c in sw)
        for pol, color in (("multifactor", "C0"), ("lru", "C1")):
            ax.errorbar(
                caps,
                [sw[str(c)][pol]["mean"] for c in caps],
                yerr=[sw[str(c)][pol]["std"] for c in caps],
                marker="o",
                capsize=3,
                color=color,
                label=pol,
            )
        ax.set_xlabel("capacity (entries)")
        ax.set_title(f"{kind}: hit ratio vs capacity (mean +- std)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
