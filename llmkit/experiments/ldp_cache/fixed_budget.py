"""LDPCache at a fixed total privacy budget: every arm over one stream under ``BudgetPlan``, the curve over
per-query budgets B/Q with problem-bootstrap intervals, and the bench's fixed-budget section.

The abstract claims higher accuracy than the baselines. The comparison it implies: a user has a total
budget B for Q queries; without a cache each query is released at B/Q, with a cache only cloud calls
spend on the query (hits cost the scheduler bit), so each call is released at a larger epsilon. The
allocation (``llmkit.serving.ldp_cache.budget.BudgetPlan``) uses public facts only. The bit costs
``bit_share`` x B/Q, at most ``bit_cap`` (the bench's --rr-epsilon).

Mechanism: the sentence-level candidate mechanism (``llmkit.serving.ldp_cache.sentence``): the query is
snapped on the device to its nearest question in a public bank and k-ary randomized response releases
a bank question (eps-LDP for any two queries). The bank is the first ``--bank`` one-step arithmetic
problems' plain questions; the streams are uniform_arith over those problems and zipf_arith with the
bank as its pool, so the bank covers every query (the favourable case for this mechanism: a query with
no close bank question would be answered for the wrong question). The cloud's answer to a bank question
is the bundled model's greedy plain answer, kept in an answers file: no LLM call is needed once it holds
the bank.

Arms (:data:`ARMS`): ``no_cache`` (every query released at B/Q), ``ldpcache`` (LDPCache's scheduler,
multi-factor eviction), ``lru`` (LDPCache's scheduler, LRU eviction), ``gptcache`` (a similarity
threshold; its decision is NOT private and is charged nothing, so it is a reference). Each arm is
averaged over seeds of the mechanism and scheduler coins, common to all arms (common random numbers).
The token mechanism is not an arm: at single-digit epsilon per query it keeps almost no word piece
(:func:`fixed_budget_section` records the exact expected keep rate). Results:
bench/results/ldp_cache_fixed_budget.md.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from llmkit.serving.ldp_cache import (
    BudgetPlan,
    CacheStore,
    CandidateMechanism,
    LDPCache,
    LDPScheduler,
    OpenAIUpstream,
    PerQueryLDP,
    PrivacyLedger,
    ThresholdScheduler,
    make_policy,
)

from .runs import MemoUpstream, pooled_bootstrap, problem_bootstrap, say, served
from .workload import WORKLOADS, build, correct, load_arith_problems

ARMS = ("no_cache", "ldpcache", "lru", "gptcache")
LABELS = {"no_cache": "no cache", "ldpcache": "LDPCache", "lru": "LRU", "gptcache": "GPTCache (not private)"}
KINDS = ("uniform_arith", "zipf_arith")


def run_fixed_budget(
    queries: list[dict],
    arm: str,
    *,
    mechanism,
    embedder,
    upstream,
    per_query: float,
    capacity: int,
    seed,
    bit_seed,
    max_tokens: int,
    bit_share: float = 0.25,
    bit_cap: float = 3.0,
    sim_threshold: float = 0.8,
    gain_threshold: float = 0.1,
) -> dict:
    """One pass of ``arm`` over the stream with total budget ``per_query * len(queries)``.

    Query i's perturbation uses the seed ``[*seed, i]`` in every arm (common random numbers).
    Returns per-query correctness, hits, the epsilon of each cloud call and the total spent.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    q = len(queries)
    total = per_query * q
    ledger = PrivacyLedger(":memory:", total)
    bit = 0.0 if arm in ("no_cache", "gptcache") else min(bit_share * per_query, bit_cap)
    plan = BudgetPlan(total, q, bit)
    if arm == "no_cache":
        client = PerQueryLDP(upstream, ledger, mechanism)
    else:
        sched = (
            ThresholdScheduler(sim_threshold)
            if arm == "gptcache"
            else LDPScheduler(bit, sim_threshold, gain_threshold)
            if bit > 0
            else None
        )
        if sched is None:
            raise ValueError("a private cache arm needs a positive bit epsilon (bit_share x per_query)")
        store = CacheStore(capacity=capacity, policy=make_policy("lru" if arm == "lru" else "multifactor"))
        client = LDPCache(upstream, ledger, store, mechanism, embedder, sched)
    rows, misses = [], 0
    for i, x in enumerate(queries):
        # the ledger rounds charges up to micro-epsilons: keep 2 of them spare per query
        remaining = ledger.remaining("default") - 2e-6
        if arm == "no_cache":
            e = plan.call_epsilon(i, remaining, i)
            a = client.ask(x["text"], seed=[*seed, i], epsilon=e, max_tokens=max_tokens, temperature=0)
        else:
            # the bit is reserved even when the cache is empty (then it is refunded): public either way
            e = plan.call_epsilon(i, remaining - bit, misses)
            a = client.ask(
                x["text"],
                seed=[*seed, i],
                bit_seed=[bit_seed, i],
                epsilon=e,
                max_tokens=max_tokens,
                temperature=0,
            )
        misses += not a.cache_hit
        rows.append(
            {
                "hit": a.cache_hit,
                "call_epsilon": None if a.cache_hit else e,
                "correct": correct(a.text, x["gold"]),
                "sent": None if a.cache_hit else a.sent_messages,
            }
        )
    calls = [r["call_epsilon"] for r in rows if r["call_epsilon"] is not None]
    return {
        "accuracy": sum(r["correct"] for r in rows) / q,
        "hit_ratio": sum(r["hit"] for r in rows) / q,
        "calls": len(calls),
        "epsilon_per_call": sum(calls) / len(calls) if calls else 0.0,
        "epsilon_per_call_min": min(calls, default=0.0),
        "spent": ledger.spent("default"),
        "total": total,
        "bit_epsilon": bit,
        "correct_per_problem": dict(Counter(x["problem"] for x, r in zip(queries, rows) if r["correct"])),
        "sent_texts": [r["sent"][0]["content"] for r in rows if r["sent"]],
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    """Average of :func:`run_fixed_budget` results over seeds (correct answers per problem averaged)."""
    keys = ("accuracy", "hit_ratio", "calls", "epsilon_per_call", "spent")
    out = {k: sum(r[k] for r in runs) / len(runs) for k in keys}
    out["epsilon_per_call_min"] = min(r["epsilon_per_call_min"] for r in runs)
    out["spent_max"] = max(r["spent"] for r in runs)
    out["total"], out["bit_epsilon"] = runs[0]["total"], runs[0]["bit_epsilon"]
    pids = {p for r in runs for p in r["correct_per_problem"]}
    out["correct_per_problem"] = {
        p: sum(r["correct_per_problem"].get(p, 0) for r in runs) / len(runs) for p in pids
    }
    out["accuracy_runs"] = [round(r["accuracy"], 4) for r in runs]
    return out


def fixed_budget_curve(
    queries: list[dict], per_query_budgets, *, repeats: int, seed, arms=ARMS, progress=None, **kw
) -> dict:
    """Every arm at every per-query budget B/Q, averaged over ``repeats`` seeds, with intervals.

    Intervals: 95% bootstrap over problems (:func:`.runs.problem_bootstrap`) of each arm's
    accuracy and of its difference from the no-cache arm at the same budget.
    """
    per_problem = dict(Counter(x["problem"] for x in queries))
    out = {}
    for b in per_query_budgets:
        cell = {}
        for arm in arms:
            runs = [
                run_fixed_budget(queries, arm, per_query=b, seed=[*seed, r], bit_seed=1000 + r, **kw)
                for r in range(repeats)
            ]
            m = mean_over_seeds(runs)
            acc = problem_bootstrap(per_problem, m["correct_per_problem"], {})
            m["accuracy_ci95"] = acc["ci95"]
            cell[arm] = m
            if progress is not None:
                progress(b, arm, m)
        for arm in arms:
            if arm != "no_cache" and "no_cache" in cell:
                d = problem_bootstrap(
                    per_problem, cell[arm]["correct_per_problem"], cell["no_cache"]["correct_per_problem"]
                )
                cell[arm]["diff_vs_no_cache"] = d["diff"]
                cell[arm]["diff_vs_no_cache_ci95"] = d["ci95"]
        out[str(b)] = cell
    return out


def pooled_at(curves: dict[str, dict], streams: dict[str, list[dict]], budget) -> dict:
    """Every arm's accuracy at one per-query budget pooled over workloads, with problem-bootstrap intervals.

    ``curves[k]`` is :func:`fixed_budget_curve`'s result for workload k over ``streams[k]``; a problem
    is a unit within its workload. Also the pooled difference of each arm from the no-cache arm.
    """
    key = str(budget)
    arms = list(next(iter(curves.values()))[key])
    out = {}
    for arm in arms:
        per = {
            k: (Counter(x["problem"] for x in streams[k]), curves[k][key][arm]["correct_per_problem"], {})
            for k in curves
        }
        acc = pooled_bootstrap(per)
        n = sum(len(streams[k]) for k in curves)
        calls = sum(curves[k][key][arm]["calls"] for k in curves)
        out[arm] = {
            "accuracy": acc["diff"],
            "accuracy_ci95": acc["ci95"],
            "epsilon_per_call": sum(
                curves[k][key][arm]["epsilon_per_call"] * curves[k][key][arm]["calls"] for k in curves
            )
            / calls
            if calls
            else 0.0,
            "hit_ratio": sum(curves[k][key][arm]["hit_ratio"] * len(streams[k]) for k in curves) / n,
        }
        if arm != "no_cache" and "no_cache" in arms:
            d = pooled_bootstrap(
                {
                    k: (
                        Counter(x["problem"] for x in streams[k]),
                        curves[k][key][arm]["correct_per_problem"],
                        curves[k][key]["no_cache"]["correct_per_problem"],
                    )
                    for k in curves
                }
            )
            out[arm]["diff_vs_no_cache"], out[arm]["diff_vs_no_cache_ci95"] = d["diff"], d["ci95"]
    return out


# ----------------------------------------------------------------------------- the bench's section


def budgets_of(budgets: str | None, quick: bool) -> list[float]:
    """The per-query budgets B/Q: a comma list, else quick 4, full 1,2,3,4,6,8,12."""
    return [float(b) for b in (budgets or ("4" if quick else "1,2,3,4,6,8,12")).split(",")]


def bank_streams(
    data: Path, bank_size: int, visits: int, seed: int
) -> tuple[list[dict], dict[str, list[dict]]]:
    """The public bank (the first ``bank_size`` arithmetic problems) and one stream per kind over it."""
    bank = load_arith_problems(data, bank_size, seed)
    return bank, {k: build(k, bank, visits, seed) for k in KINDS}


def plain_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def answer_bank(
    memo: MemoUpstream,
    bank: list[dict],
    params: dict,
    *,
    url: str | None,
    model: str | None,
    engine: str,
    concurrency: int,
    cwd=None,
    upstream_cls=None,
    log: Callable = say,
) -> dict[int, bool]:
    """Ask the model once per bank question not on file yet (``llmkit serve`` is started when ``url`` is None),
    then freeze ``memo`` so that any other call fails; returns whether each plain answer is right."""
    missing = [
        p
        for p in bank
        if json.dumps([plain_messages(p["question"]), params], sort_keys=True) not in memo.memo
    ]
    if missing:
        upstream_cls = upstream_cls or OpenAIUpstream
        if url is None:
            log(f"{len(missing)} bank answers missing: starting llmkit serve ...")
        with served(url, engine, cwd) as base:
            memo.upstream = upstream_cls(base, model=model, timeout=3600.0)
            with cf.ThreadPoolExecutor(concurrency) as ex:
                list(ex.map(lambda p: memo(plain_messages(p["question"]), **params), missing))

    def refuse(messages, **kw):
        raise RuntimeError(f"no answer on file for {messages!r}")

    memo.upstream = refuse  # every candidate is answered now; anything else is a bug
    return {i: correct(memo(plain_messages(p["question"]), **params), p["gold"]) for i, p in enumerate(bank)}


def budget_line(name: str, b: float, arms: dict) -> str:
    """One printed line per workload (or pooled) and budget."""

    def diff(a):
        lo, hi = arms[a]["diff_vs_no_cache_ci95"]
        return f"{arms[a]['diff_vs_no_cache']:+.3f} [{lo:+.3f}, {hi:+.3f}]"

    return (
        f"[fixed budget, {name}] B/Q {b:g}: accuracy "
        + ", ".join(
            f"{LABELS[a]} {arms[a]['accuracy']:.3f} [{arms[a]['accuracy_ci95'][0]:.3f}, "
            f"{arms[a]['accuracy_ci95'][1]:.3f}]"
            for a in ARMS
        )
        + "; epsilon per cloud call "
        + ", ".join(f"{LABELS[a]} {arms[a]['epsilon_per_call']:.2f}" for a in ARMS)
        + f"; hit ratio LDPCache {arms['ldpcache']['hit_ratio']:.3f}; LDPCache - no cache {diff('ldpcache')}, "
        f"LRU - no cache {diff('lru')}"
    )


def token_keep_rate(token_mechanism, streams: dict, pooled_cell: dict, n: int = 20) -> dict:
    """Expected share of word pieces the token mechanism would keep at the pooled epsilons per call of the
    no-cache and LDPCache arms (exact expectation over the first ``n`` uniform_arith queries)."""
    texts = [x["text"] for x in streams["uniform_arith"][:n]]
    return {
        a: sum(token_mechanism.expected_keep_rate(t, pooled_cell[a]["epsilon_per_call"]) for t in texts)
        / len(texts)
        for a in ("no_cache", "ldpcache")
    }


def fixed_budget_figures(curves: dict, pooled: dict, budgets: list[float], plain: dict[int, bool]) -> dict:
    """The figure keys of the first budget (the bench's last-line JSON)."""
    b0 = str(budgets[0])
    pa = pooled[b0]
    figures = {
        "epsilon_per_query": budgets[0],
        "accuracy_fixed_budget_no_cache": round(pa["no_cache"]["accuracy"], 4),
        "accuracy_fixed_budget_cache": round(pa["ldpcache"]["accuracy"], 4),
        "accuracy_fixed_budget_lru": round(pa["lru"]["accuracy"], 4),
        "accuracy_fixed_budget_gptcache_not_private": round(pa["gptcache"]["accuracy"], 4),
        "accuracy_fixed_budget_diff_cache_ci95": [
            round(x, 4) for x in pa["ldpcache"]["diff_vs_no_cache_ci95"]
        ],
        "epsilon_per_cloud_call_fixed_budget_cache": round(pa["ldpcache"]["epsilon_per_call"], 4),
        "hit_ratio_fixed_budget_cache": round(pa["ldpcache"]["hit_ratio"], 4),
        "accuracy_plain_bank": round(sum(plain.values()) / len(plain), 4),
    }
    for k in curves:
        c = curves[k][b0]
        figures[f"accuracy_fixed_budget_no_cache_{k}"] = round(c["no_cache"]["accuracy"], 4)
        figures[f"accuracy_fixed_budget_cache_{k}"] = round(c["ldpcache"]["accuracy"], 4)
    return figures


def config_of(settings) -> dict:
    """The bench's flags as JSON (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(settings).items()}


def fixed_budget_section(
    settings,
    embedder,
    capacity: int,
    max_tokens: int,
    token_mechanism=None,
    *,
    cwd=None,
    upstream_cls=None,
    log: Callable = say,
) -> tuple[dict, dict]:
    """The fixed-total-budget experiment; returns (the JSON section, its figure keys).

    ``settings`` holds the bench's flags: quick, budgets, budget_repeats, data, bank, budget_visits,
    budget_answers, seed, upstream, model, server_engine, concurrency, bit_share, rr_epsilon,
    sim_threshold, gain_threshold.
    """
    s = settings
    budgets = budgets_of(s.budgets, s.quick)
    repeats = s.budget_repeats or (5 if s.quick else 10)
    bank, streams = bank_streams(s.data, s.bank, s.budget_visits, s.seed)
    mech = CandidateMechanism([p["question"] for p in bank], embedder, budgets[0])
    memo = MemoUpstream(None, s.budget_answers)
    plain = answer_bank(
        memo,
        bank,
        {"max_tokens": max_tokens, "temperature": 0},
        url=s.upstream,
        model=s.model,
        engine=s.server_engine,
        concurrency=s.concurrency,
        cwd=cwd,
        upstream_cls=upstream_cls,
        log=log,
    )
    log(
        f"fixed budget: bank of {len(bank)} public candidate questions (the model answers {sum(plain.values())} "
        "right when asked plainly); streams "
        + ", ".join(
            f"{k} {len(streams[k])} queries over {len({x['problem'] for x in streams[k]})} problems"
            for k in KINDS
        )
        + f"; capacity {capacity}; bit = {s.bit_share:g} x B/Q (at most {s.rr_epsilon:g}); {repeats} seeds"
    )
    t0 = time.time()
    curves = {
        k: fixed_budget_curve(
            streams[k],
            budgets,
            repeats=repeats,
            seed=[s.seed, WORKLOADS.index(k), 7],
            mechanism=mech,
            embedder=embedder,
            upstream=memo,
            capacity=capacity,
            max_tokens=max_tokens,
            bit_share=s.bit_share,
            bit_cap=s.rr_epsilon,
            sim_threshold=s.sim_threshold,
            gain_threshold=s.gain_threshold,
        )
        for k in KINDS
    }
    pooled = {}
    for b in budgets:
        pooled[str(b)] = pa = pooled_at(curves, streams, b)
        for name, arms in [*((k, curves[k][str(b)]) for k in KINDS), ("pooled", pa)]:
            log(budget_line(name, b, arms))
        if token_mechanism is not None:  # why the token mechanism is not an arm here (no LLM call needed)
            keep = pa["token_mechanism_keep_rate"] = token_keep_rate(token_mechanism, streams, pa)
            log(
                f"[fixed budget] the token mechanism at the same epsilons would keep {keep['no_cache']:.2e} "
                f"(no cache) / {keep['ldpcache']:.2e} (LDPCache's epsilon per call) of the word pieces "
                f"(exact expectation over 20 queries; at eps/token 38 it keeps ~0.98)"
            )
    log(f"fixed budget: {time.time() - t0:.0f} s, no LLM call beyond the bank's answers")
    figures = fixed_budget_figures(curves, pooled, budgets, plain)
    section = {
        "budgets_per_query": budgets,
        "total_budget": {k: [b * len(streams[k]) for b in budgets] for k in KINDS},
        "queries": {k: len(streams[k]) for k in KINDS},
        "bank": len(bank),
        "bank_plain_correct": sum(plain.values()),
        "capacity": capacity,
        "repeats": repeats,
        "bit_share": s.bit_share,
        "bit_cap": s.rr_epsilon,
        "mechanism": mech.name,
        "pooled": pooled,
        "curves": {
            k: {
                b: {
                    a: {kk: vv for kk, vv in m.items() if kk != "correct_per_problem"}
                    for a, m in cell.items()
                }
                for b, cell in curves[k].items()
            }
            for k in KINDS
        },
        "figures": figures,
        "config": config_of(s),
    }
    return section, figures


def write_fixed_budget(section: dict, out_dir: Path, stem: str) -> Path:
    """``<stem>.json`` and ``<stem>.png`` (accuracy with 95% intervals and epsilon per call vs B/Q)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(section, indent=2))
    budgets = section["budgets_per_query"]
    panels = [*section["curves"].items(), ("pooled", section["pooled"])]
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 8), squeeze=False)
    labels = {
        "gptcache": "GPTCache (not private)",
        "no_cache": "no cache (B/Q per query)",
        "ldpcache": "LDPCache (multi-factor)",
        "lru": "LDPCache scheduler, LRU",
    }
    for j, (name, curve) in enumerate(panels):
        for i, (arm, color) in enumerate(
            (("no_cache", "grey"), ("ldpcache", "C0"), ("lru", "C1"), ("gptcache", "C2"))
        ):
            xs = [b * (1 + 0.02 * (i - 1.5)) for b in budgets]  # small offsets so the bars do not overlap
            acc = [curve[str(b)][arm]["accuracy"] for b in budgets]
            lo = [a - curve[str(b)][arm]["accuracy_ci95"][0] for a, b in zip(acc, budgets)]
            hi = [curve[str(b)][arm]["accuracy_ci95"][1] - a for a, b in zip(acc, budgets)]
            axes[0][j].errorbar(xs, acc, yerr=[lo, hi], marker="o", capsize=3, color=color, label=labels[arm])
            axes[1][j].plot(
                budgets,
                [curve[str(b)][arm]["epsilon_per_call"] for b in budgets],
                marker="o",
                color=color,
                label=labels[arm],
            )
        axes[0][j].set_title(f"{name}: accuracy at a fixed total budget (95% CI)")
        axes[1][j].set_title(f"{name}: epsilon per cloud call")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.set_xlabel("per-query budget B/Q (total B = B/Q x queries)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}.png", dpi=100)
    plt.close(fig)
    return out_dir / f"{stem}.json"
