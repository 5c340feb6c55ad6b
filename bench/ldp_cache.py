"""LDPCache benchmark: privacy budget per answered query, accuracy, and eviction hit ratios.

Paper: LDPCache (../shared/seeds/004_ead6308da16bc4ed.txt). Anchors measured in the same run:
per-query LDP without a cache (budget, accuracy), LRU eviction at the same capacity (hit
ratio), and a GPTCache-style similarity-threshold cache (hit ratio; its decision is not
private, so it is a reference only).

Workloads (from GSM8K train, ../shared/data/gsm8k/train.jsonl; both are reported)
    Problems: short GSM8K train problems (at most two calculator steps, --max-steps; at most
    45 words), shuffled with a fixed seed (session 1's problem set). A stream is a sequence of *visits*; a visit is 2-4
    consecutive queries that are templated variants of one problem (the same question
    wrapped as "Solve this math word problem: ...", "... Think step by step.", "I need
    help with my homework. ...", etc., drawn without replacement from 8 templates; the
    answer never changes). Consecutive queries are therefore semantically correlated.
    The two workloads differ only in which problem a visit is about:

    uniform   (session 1's workload) the first visit takes problem 0; every later visit
              returns to an earlier problem with probability 0.5, chosen uniformly among
              the problems seen so far (not the one just visited), else takes the next
              new problem. All earlier problems are equally likely to come back, so
              neither recency nor frequency predicts the next revisit.
    zipf      the standard skewed-popularity caching workload (independent reference
              model with Zipf popularity, as in web/CDN and LLM-query traces): a pool
              of N problems is put in a random popularity order (workload seed) and
              every visit draws its problem independently with P(rank k) = k^-s / H,
              s = 1.0 (k = 1..N). A few problems are asked often, a long tail once or
              never; problems that never come up cost nothing. Consecutive visits may
              hit the same problem (then the visit is simply longer).

    Sizes: quick uniform 6 problems / 12 visits, zipf pool 12 / 12 visits; full
    uniform 20 / 45, zipf pool 40 / 45.

    uniform_arith, zipf_arith  (added in session 3b; the two above are unchanged) the
              same streams (same visit structure, templates, uniform / Zipf visit
              choice, sizes, capacity and privacy parameters) over a second problem set
              that the bundled model can answer, so that accuracy separates the arms
              (on the sets above the model gets ~0% right even without privacy).
              Construction, fixed before any model run on it: GSM8K train problems
              of at most 45 words (no step limit), shuffled with the same seed; from
              each, the first calculator annotation <<a op b=c>> of the solution with
              a, b, c plain non-negative integers, op one of + - * /, a op b == c
              exactly (checked, so GSM8K's rare wrong annotations are skipped) and
              a, b, c <= 100; the problem's text without its last sentence (the
              question) is kept as context, so the entities stay and different
              problems stay semantically distinct; the question becomes
              "<context> What is <a> plus|minus|times|divided by <b>?" with gold
              answer c. Problems without such an annotation, or of one sentence,
              are skipped. Example: "Natalia sold clips to 48 of her friends in
              April, and then she sold half as many clips in May. What is 48
              divided by 2?" -> 24. Results go to ldp_cache_arith[_quick].json; their
              figure keys end in _uniform_arith / _zipf_arith.
              Full sizes (session 4): uniform_arith 120 problems / 240 visits,
              zipf_arith pool 200 / 240 visits (~710 queries each; quick as above).
              Why: with 20 / 40 problems and 45 visits (session 3) the accuracy
              difference's 95% interval was about +-0.13 wide, so neither "equal"
              nor "worse" could be told apart. A cached answer is one noisy sample
              (the model's answer to one perturbed query) reused on every hit, so
              per problem the cache is right on all its hits or on none: the
              variance is across problems, and only more problems narrow it.
              That run's answers (the bundled model behind `llmkit serve --engine
              vllm`) are in bench/results/ldp_cache_parts/answers_arith.jsonl.gz;
              `--workloads uniform_arith,zipf_arith --answers <that file> --upstream
              http://127.0.0.1:9 --model smollm2-135m-instruct` replays it without a model.

    "Equal or better accuracy" is judged as non-inferiority, with the margin fixed
    before the large run: the lower end of the 95% bootstrap interval (over problems) of
    accuracy(LDPCache) - accuracy(no cache) must be >= -0.05 (MARGIN), per workload and
    pooled over the workloads of the run. Why non-inferiority and not a better point
    estimate: in expectation the cache is as accurate as the no-cache arm (a reused answer
    was produced for another perturbed variant of the same question, which is as likely to
    be right), so the point estimate lands on either side of 0 by chance.

Fixed total budget (issue 23; --fixed-budget-only runs just this, --quick runs it at B/Q 4)
    The abstract's claim is higher accuracy than the baselines. The comparison it implies: a
    user has a total budget B for a stream of Q queries; without a cache each query is released
    at B/Q, with a cache only cloud calls spend on the query (hits cost the scheduler bit), so
    each call is released at a larger epsilon. Allocation before each query from public facts
    only (remaining budget, future bits reserved, running rate of *released* misses):
    llmkit/serving/ldp_cache/budget.py. The bit costs 0.25 x B/Q (at most --rr-epsilon).
    Mechanism: the sentence-level candidate mechanism (llmkit/serving/ldp_cache/sentence.py):
    the query is snapped on the device to its nearest question in a public bank and k-ary
    randomized response releases a bank question (eps-LDP for any two queries). The bank is the
    first --bank (120) one-step arithmetic problems' plain questions; the streams are
    uniform_arith (120 problems) and zipf_arith (pool = the same 120) with --budget-visits 240
    visits of templated variants, so the bank covers every query (the favourable case for this
    mechanism: a query with no close bank question would be answered for the wrong question).
    The cloud's answer to a bank question is the bundled model's greedy plain answer, on file in
    ldp_cache_parts/answers_arith.jsonl.gz (session 4's plain asks): no LLM call is needed.
    Arms: no cache, LDPCache (multi-factor eviction), LRU (LDPCache's scheduler, LRU eviction),
    GPTCache (similarity threshold; its decision is not private and is charged nothing: a
    reference). Capacity as above (quick 3, full 8). Each arm is averaged over --budget-repeats
    seeds (mechanism and scheduler coins, common to all arms); intervals are 95% bootstrap over
    problems, per workload and pooled. The token mechanism is not an arm: at single-digit
    epsilon per query it keeps ~3.5e-5 of the word pieces (the bench prints the exact figure).
    Results: ldp_cache_fixed_budget[_quick].json and .png.

Pipeline
    The bundled model is served by ``llmkit serve`` (started here as a subprocess, hf engine
    with one thread; --server-engine vllm for vLLM's engine, which the session-4 arithmetic
    run used: ~1600 answers in ~10 min on 2 cores instead of ~1 h). Every
    query sent upstream is perturbed by the token exponential mechanism (eps per word piece,
    so a query costs eps x its length). The no-cache baseline sends every query. LDPCache
    sends only its misses; a hit costs the randomized-response bit (rr-epsilon).
    Common random numbers: query i of a workload is perturbed with the seed (seed, workload,
    i) in every run, so a cache miss on query i sends exactly the text the baseline sent
    for query i, and the (greedy) upstream answer is reused from the baseline's call. All
    arms are thus judged on the same perturbed texts and the same model answers; the LLM is
    called once per query in total (plus one plain, unperturbed ask per distinct problem
    for the no-privacy reference). Answers can be kept in a JSONL file (--answers), so a
    long run split over several invocations resumes without asking again.
    The cache arms are repeated over several seeds of the scheduler's coin (no new LLM
    calls) and averaged; min/max are reported.

Hit-ratio sweep (no LLM calls)
    Hits do not depend on the response texts (the scheduler sees raw-query embeddings and
    the fidelity of the perturbed query), so hit ratios for more workload seeds and
    capacities are simulated exactly with a stand-in upstream that returns "". Each cell
    pairs multi-factor and LRU on the same stream and scheduler seed; reported: mean,
    std and min/max over (workload seed x scheduler seed), and the mean paired difference
    with its standard error and the share of pairs where multi-factor is higher.
    These seeds are held out: the multi-factor weights were chosen on other traces (GSM8K
    problem seed 1, workload seeds 100-105; see llmkit/serving/ldp_cache/eviction.py).
    --eviction-ablation: the same pairing for multi-factor with factors removed or a
    frequency factor added, and for LRU and multi-factor with session 2's scheduler input
    (E[acc | cloud] averaged over the surviving entries only), which made the hit test
    depend on the eviction policy.

Accuracy: the last number in the answer equals the GSM8K answer (answers up to
--max-tokens tokens, default 256). SmolLM2-135M is very weak on GSM8K: asked plainly
(no privacy, greedy, 256 tokens) it got 1 of 32 of these problems right and 0 of 48
one-step ones (probes before this run), so accuracy is near 0 in every arm and cannot
separate them. We therefore also report *agreement with the no-privacy answer*: the
share of queries whose answer ends in the same number as the model's plain, unperturbed
answer to the same problem (a utility measure common in private-inference work: how much
of the non-private output survives). It is defined for right and wrong answers alike.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
BANK_ANSWERS = REPO / "bench" / "results" / "ldp_cache_parts" / "answers_arith.jsonl.gz"

from llmkit.serving.ldp_cache.experiment import (
    ABLATION,
    MARGIN,
    MemoEmbedder,
    MemoMechanism,
    MemoUpstream,
    evaluate_workload,
    eviction_ablation,
    free_port,
    noninferior,
    pooled_bootstrap,
    start_server,
    sweep,
)
from llmkit.serving.ldp_cache.workload import (
    FULL_SIZES,
    FULL_VISITS,
    QUICK_SIZES,
    QUICK_VISITS,
    WORKLOADS,
    ZIPF_S,
    build,
    correct,
    load_arith_problems,
    load_problems,
)


def run_ablation(
    args, kinds, problem_sets, visits, caps, sweep_seeds, sweep_repeats, mechanism, embedder, sched
) -> int:
    t0 = time.time()
    res = {}
    for k in kinds:
        res[k] = eviction_ablation(
            k,
            problem_sets[k],
            visits[k],
            mechanism,
            embedder,
            sched,
            workload_seeds=range(args.seed, args.seed + sweep_seeds),
            capacities=caps,
            repeats=sweep_repeats,
            seed=args.seed,
        )
        for cap, cell in res[k].items():
            print(
                f"[{k}] ablation capacity {cap} ({sweep_seeds} workload x {sweep_repeats} scheduler seeds): "
                + "; ".join(
                    f"{name} {c['mean']:.3f} ({c['diff_vs_lru']:+.3f} +- {c['diff_se']:.3f} vs LRU)"
                    for name, c in cell.items()
                ),
                flush=True,
            )
    out = REPO / "bench" / "results" / "ldp_cache_eviction_ablation.json"
    out.write_text(
        json.dumps(
            {
                "ablation": res,
                "policies": {k: str(v) for k, v in ABLATION.items()},
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "visits": {k: visits[k] for k in kinds},
                "capacities": caps,
                "workload_seeds": sweep_seeds,
                "scheduler_seeds": sweep_repeats,
            },
            indent=2,
        )
    )
    print(f"wrote {out} ({time.time() - t0:.0f} s; no LLM calls)")
    return 0


def plot(result: dict, path: Path) -> None:
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
            [x - 0.2 for x in xs],
            [w["arms"][a].get("accuracy", 0.0) for a in arms],
            0.4,
            label="accuracy",
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
            m = [sw[str(c)][pol]["mean"] for c in caps]
            sd = [sw[str(c)][pol]["std"] for c in caps]
            ax.errorbar(caps, m, yerr=sd, marker="o", capsize=3, color=color, label=pol)
        ax.set_xlabel("capacity (entries)")
        ax.set_title(f"{kind}: hit ratio vs capacity (mean +- std)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fixed_budget_section(args, embedder, capacity: int, max_tokens: int, upstream_cls, token_mechanism=None):
    """The fixed-total-budget experiment (module docstring); returns (result section, figure keys)."""
    from llmkit.serving.ldp_cache.budget import ARMS, fixed_budget_curve, pooled_at
    from llmkit.serving.ldp_cache.sentence import CandidateMechanism

    q = args.quick
    budgets = [float(b) for b in (args.budgets or ("4" if q else "1,2,3,4,6,8,12")).split(",")]
    repeats = args.budget_repeats or (5 if q else 10)
    bank = load_arith_problems(args.data, args.bank, args.seed)
    kinds = ("uniform_arith", "zipf_arith")
    streams = {k: build(k, bank, args.budget_visits, args.seed) for k in kinds}
    mech = CandidateMechanism([p["question"] for p in bank], embedder, budgets[0])
    params = {"max_tokens": max_tokens, "temperature": 0}
    memo = MemoUpstream(None, args.budget_answers)
    missing = [p for p in bank if json.dumps([[{"role": "user", "content": p["question"]}], params],
                                             sort_keys=True) not in memo.memo]
    proc = None
    try:
        if missing:  # the bank's answers not yet on file: ask the model once per candidate
            url = args.upstream
            if not url:
                port = free_port()
                print(f"{len(missing)} bank answers missing: starting llmkit serve on port {port} ...", flush=True)
                proc = start_server(port, engine=args.server_engine, cwd=REPO)
                url = f"http://127.0.0.1:{port}"
            memo.upstream = upstream_cls(url, model=args.model, timeout=3600.0)
            with cf.ThreadPoolExecutor(args.concurrency) as ex:
                list(ex.map(lambda p: memo([{"role": "user", "content": p["question"]}], **params), missing))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    def refuse(messages, **kw):
        raise RuntimeError(f"no answer on file for {messages!r}")

    memo.upstream = refuse  # every candidate is answered now; anything else is a bug
    plain = {i: correct(memo([{"role": "user", "content": p["question"]}], **params), p["gold"])
             for i, p in enumerate(bank)}
    print(
        f"fixed budget: bank of {len(bank)} public candidate questions (the model answers {sum(plain.values())} "
        f"right when asked plainly); streams "
        + ", ".join(f"{k} {len(streams[k])} queries over {len({x['problem'] for x in streams[k]})} problems"
                    for k in kinds)
        + f"; capacity {capacity}; bit = {args.bit_share:g} x B/Q (at most {args.rr_epsilon:g}); {repeats} seeds",
        flush=True,
    )
    t0 = time.time()
    curves = {
        k: fixed_budget_curve(
            streams[k], budgets, repeats=repeats, seed=[args.seed, WORKLOADS.index(k), 7], mechanism=mech,
            embedder=embedder, upstream=memo, capacity=capacity, max_tokens=max_tokens,
            bit_share=args.bit_share, bit_cap=args.rr_epsilon, sim_threshold=args.sim_threshold,
            gain_threshold=args.gain_threshold,
        )
        for k in kinds
    }
    labels = {"no_cache": "no cache", "ldpcache": "LDPCache", "lru": "LRU", "gptcache": "GPTCache (not private)"}
    pooled = {}
    for b in budgets:
        pooled[str(b)] = pa = pooled_at(curves, streams, b)
        for k, arms in [*((k, curves[k][str(b)]) for k in kinds), ("pooled", pa)]:
            print(
                f"[fixed budget, {k}] B/Q {b:g}: accuracy "
                + ", ".join(f"{labels[a]} {arms[a]['accuracy']:.3f} [{arms[a]['accuracy_ci95'][0]:.3f}, "
                            f"{arms[a]['accuracy_ci95'][1]:.3f}]" for a in ARMS)
                + "; epsilon per cloud call "
                + ", ".join(f"{labels[a]} {arms[a]['epsilon_per_call']:.2f}" for a in ARMS)
                + f"; hit ratio LDPCache {arms['ldpcache']['hit_ratio']:.3f}; LDPCache - no cache "
                f"{arms['ldpcache']['diff_vs_no_cache']:+.3f} [{arms['ldpcache']['diff_vs_no_cache_ci95'][0]:+.3f}, "
                f"{arms['ldpcache']['diff_vs_no_cache_ci95'][1]:+.3f}], LRU - no cache "
                f"{arms['lru']['diff_vs_no_cache']:+.3f} [{arms['lru']['diff_vs_no_cache_ci95'][0]:+.3f}, "
                f"{arms['lru']['diff_vs_no_cache_ci95'][1]:+.3f}]",
                flush=True,
            )
        if token_mechanism is not None:  # why the token mechanism is not an arm here (no LLM call needed)
            texts = [x["text"] for x in streams["uniform_arith"][:20]]
            keep = {a: sum(token_mechanism.expected_keep_rate(t, pa[a]["epsilon_per_call"]) for t in texts)
                    / len(texts) for a in ("no_cache", "ldpcache")}
            pa["token_mechanism_keep_rate"] = keep
            print(f"[fixed budget] the token mechanism at the same epsilons would keep {keep['no_cache']:.2e} "
                  f"(no cache) / {keep['ldpcache']:.2e} (LDPCache's epsilon per call) of the word pieces "
                  f"(exact expectation over {len(texts)} queries; at eps/token 38 it keeps ~0.98)", flush=True)
    print(f"fixed budget: {time.time() - t0:.0f} s, no LLM call beyond the bank's answers")
    b0 = str(budgets[0])
    pa = pooled[b0]
    figures = {
        "epsilon_per_query": budgets[0],
        "accuracy_fixed_budget_no_cache": round(pa["no_cache"]["accuracy"], 4),
        "accuracy_fixed_budget_cache": round(pa["ldpcache"]["accuracy"], 4),
        "accuracy_fixed_budget_lru": round(pa["lru"]["accuracy"], 4),
        "accuracy_fixed_budget_gptcache_not_private": round(pa["gptcache"]["accuracy"], 4),
        "accuracy_fixed_budget_diff_cache_ci95": [round(x, 4) for x in pa["ldpcache"]["diff_vs_no_cache_ci95"]],
        "epsilon_per_cloud_call_fixed_budget_cache": round(pa["ldpcache"]["epsilon_per_call"], 4),
        "hit_ratio_fixed_budget_cache": round(pa["ldpcache"]["hit_ratio"], 4),
        "accuracy_plain_bank": round(sum(plain.values()) / len(plain), 4),
    }
    for k in kinds:
        c = curves[k][b0]
        figures[f"accuracy_fixed_budget_no_cache_{k}"] = round(c["no_cache"]["accuracy"], 4)
        figures[f"accuracy_fixed_budget_cache_{k}"] = round(c["ldpcache"]["accuracy"], 4)
    section = {
        "budgets_per_query": budgets,
        "total_budget": {k: [b * len(streams[k]) for b in budgets] for k in kinds},
        "queries": {k: len(streams[k]) for k in kinds},
        "bank": len(bank),
        "bank_plain_correct": sum(plain.values()),
        "capacity": capacity,
        "repeats": repeats,
        "bit_share": args.bit_share,
        "bit_cap": args.rr_epsilon,
        "mechanism": mech.name,
        "pooled": pooled,
        "curves": {k: {b: {a: {kk: vv for kk, vv in m.items() if kk != "correct_per_problem"}
                           for a, m in cell.items()} for b, cell in curves[k].items()} for k in kinds},
        "figures": figures,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    return section, figures


def write_fixed_budget(section: dict, quick: bool, stem: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = stem or "ldp_cache_fixed_budget" + ("_quick" if quick else "")
    out = REPO / "bench" / "results"
    (out / f"{stem}.json").write_text(json.dumps(section, indent=2))
    budgets = section["budgets_per_query"]
    panels = [*section["curves"].items(), ("pooled", section["pooled"])]
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 8), squeeze=False)
    for j, (name, curve) in enumerate(panels):
        for i, (arm, color) in enumerate((("no_cache", "grey"), ("ldpcache", "C0"), ("lru", "C1"),
                                          ("gptcache", "C2"))):
            xs = [b * (1 + 0.02 * (i - 1.5)) for b in budgets]  # small offsets so the bars do not overlap
            acc = [curve[str(b)][arm]["accuracy"] for b in budgets]
            lo = [a - curve[str(b)][arm]["accuracy_ci95"][0] for a, b in zip(acc, budgets)]
            hi = [curve[str(b)][arm]["accuracy_ci95"][1] - a for a, b in zip(acc, budgets)]
            label = {"gptcache": "GPTCache (not private)", "no_cache": "no cache (B/Q per query)",
                     "ldpcache": "LDPCache (multi-factor)", "lru": "LDPCache scheduler, LRU"}[arm]
            axes[0][j].errorbar(xs, acc, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label)
            axes[1][j].plot(budgets, [curve[str(b)][arm]["epsilon_per_call"] for b in budgets], marker="o",
                            color=color, label=label)
        axes[0][j].set_title(f"{name}: accuracy at a fixed total budget (95% CI)")
        axes[1][j].set_title(f"{name}: epsilon per cloud call")
        for ax in axes[:, j]:
            ax.set_xscale("log")
            ax.set_xlabel("per-query budget B/Q (total B = B/Q x queries)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    plt.close(fig)
    print(f"wrote {out / (stem + '.json')} and {stem}.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (several minutes on 1 core)")
    ap.add_argument(
        "--workloads",
        default="uniform,zipf",
        help="comma list of: uniform, zipf, uniform_arith, zipf_arith (the _arith ones are written to "
        "ldp_cache_arith[_quick].json)",
    )
    ap.add_argument(
        "--problems",
        type=int,
        default=None,
        help="uniform[_arith]: distinct problems (quick 6; full 20, arith 120)",
    )
    ap.add_argument(
        "--pool", type=int, default=None, help="zipf[_arith]: problem pool (quick 12; full 40, arith 200)"
    )
    ap.add_argument(
        "--visits",
        type=int,
        default=None,
        help="visits per workload (2-4 variants each; quick 12; full 45, arith 240)",
    )
    ap.add_argument(
        "--server-engine",
        choices=("hf", "vllm"),
        default="hf",
        help="engine of the `llmkit serve` started here (hf: one thread, the default; vllm: faster on CPU)",
    )
    ap.add_argument(
        "--concurrency", type=int, default=16, help="LLM requests in flight at once (the server batches them)"
    )
    ap.add_argument("--capacity", type=int, default=None, help="cache entries (quick 3, full 8)")
    ap.add_argument("--epsilon-per-token", type=float, default=38.0)
    ap.add_argument("--rr-epsilon", type=float, default=3.0)
    ap.add_argument("--sim-threshold", type=float, default=0.8)
    ap.add_argument("--gain-threshold", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=256, help="answer length")
    ap.add_argument(
        "--repeats", type=int, default=None, help="scheduler-coin seeds per cache arm (quick 5, full 20)"
    )
    ap.add_argument(
        "--sweep-seeds",
        type=int,
        default=None,
        help="workload seeds in the hit-ratio sweep (quick 3, full 5)",
    )
    ap.add_argument(
        "--sweep-repeats",
        type=int,
        default=None,
        help="scheduler seeds per workload seed in the sweep (quick 4, full 8)",
    )
    ap.add_argument("--sweep-capacities", default=None, help="comma list (quick 2,3,4,6; full 2,3,4,6,8,12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eviction-ablation",
        action="store_true",
        help="only the no-LLM eviction ablation "
        "(multi-factor with factors removed vs LRU); writes ldp_cache_eviction_ablation.json",
    )
    ap.add_argument("--max-steps", type=int, default=2, help="calculator steps per GSM8K problem, at most")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument(
        "--answers",
        type=Path,
        default=None,
        help="JSONL file of upstream answers to reuse and extend (resume a split run)",
    )
    ap.add_argument(
        "--upstream",
        default=None,
        help="use a running OpenAI-compatible server instead of starting `llmkit serve`",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model name to request (default: the upstream's first listed model). With --answers "
        "holding every answer, --upstream http://127.0.0.1:9 --model NAME replays a run without a server "
        "(a missing answer then fails loudly)",
    )
    fb = ap.add_argument_group("fixed total budget (issue 23; candidate mechanism; see the module docstring)")
    fb.add_argument("--fixed-budget-only", action="store_true",
                    help="only the fixed-budget experiment; writes ldp_cache_fixed_budget[_quick].json/.png")
    fb.add_argument("--budgets", default=None,
                    help="comma list of per-query budgets B/Q (quick 4; full 1,2,3,4,6,8,12)")
    fb.add_argument("--bank", type=int, default=120,
                    help="public candidate bank: the first N one-step arithmetic problems (their questions)")
    fb.add_argument("--budget-visits", type=int, default=240, help="visits per fixed-budget stream")
    fb.add_argument("--budget-repeats", type=int, default=None,
                    help="mechanism/scheduler seeds per arm and budget (quick 5, full 10)")
    fb.add_argument("--bit-share", type=float, default=0.25,
                    help="the scheduler bit's epsilon as a share of B/Q (at most --rr-epsilon)")
    fb.add_argument("--fixed-budget-out", default=None,
                    help="file stem for the fixed-budget JSON/PNG (default ldp_cache_fixed_budget[_quick])")
    fb.add_argument("--budget-answers", type=Path, default=BANK_ANSWERS,
                    help="answers file for the bank's questions (the session-4 arithmetic run's plain asks)")
    args = ap.parse_args(argv)
    q = args.quick
    kinds = [k.strip() for k in args.workloads.split(",") if k.strip()]
    for k in kinds:
        if k not in WORKLOADS:
            print(f"unknown workload {k!r} (choose from {', '.join(WORKLOADS)})", file=sys.stderr)
            return 2
    sizes = {
        k: (args.pool if k.startswith("zipf") else args.problems) or n
        for k, n in (QUICK_SIZES if q else FULL_SIZES).items()
    }
    visits_of = {k: args.visits or (QUICK_VISITS if q else FULL_VISITS[k]) for k in WORKLOADS}
    capacity = args.capacity or (3 if q else 8)
    max_tokens = args.max_tokens
    repeats = args.repeats or (5 if q else 20)
    sweep_seeds = args.sweep_seeds or (3 if q else 5)
    sweep_repeats = args.sweep_repeats or (4 if q else 8)
    caps = [int(c) for c in (args.sweep_capacities or ("2,3,4,6" if q else "2,3,4,6,8,12")).split(",")]
    if not args.data.is_file():
        print(f"no such file: {args.data}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # SIGTERM -> SystemExit, so the `finally` below still stops the server subprocess
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from tqdm import tqdm

    from llmkit.serving.ldp_cache import (
        ExponentialTokenMechanism,
        LDPScheduler,
        OpenAIUpstream,
        PerQueryLDP,
        PrivacyLedger,
    )
    from llmkit.serving.ldp_cache.embedder import MiniLMEmbedder

    problem_sets = {
        k: load_arith_problems(args.data, sizes[k], args.seed)
        if k.endswith("_arith")
        else load_problems(args.data, sizes[k], args.seed, args.max_steps)
        for k in kinds
    }
    streams = {k: build(k, problem_sets[k], visits_of[k], args.seed) for k in kinds}
    for k in kinds:
        qs = streams[k]
        counts = sorted(
            (sum(x["problem"] == p for x in qs) for p in {x["problem"] for x in qs}), reverse=True
        )
        print(
            f"workload {k}: {len(qs)} queries, {len(counts)} distinct GSM8K train problems"
            f"{' (one-step arithmetic from their annotations)' if k.endswith('_arith') else ''} "
            f"(queries per problem {counts}), {visits_of[k]} visits of 2-4 templated variants",
            flush=True,
        )

    t0 = time.time()
    mechanism = MemoMechanism(ExponentialTokenMechanism.from_minilm(args.epsilon_per_token))
    embedder = MemoEmbedder(MiniLMEmbedder())

    def sched():
        return LDPScheduler(args.rr_epsilon, args.sim_threshold, args.gain_threshold)

    if args.eviction_ablation:
        return run_ablation(
            args, kinds, problem_sets, visits_of, caps, sweep_seeds, sweep_repeats, mechanism, embedder, sched
        )
    if args.fixed_budget_only:
        section, figures = fixed_budget_section(args, embedder, capacity, max_tokens, OpenAIUpstream, mechanism)
        write_fixed_budget(section, q, args.fixed_budget_out)
        print(json.dumps(figures))
        return 0

    proc = None
    results: dict[str, dict] = {}
    try:
        if args.upstream:
            url = args.upstream
        else:
            port = free_port()
            print(f"starting llmkit serve on port {port} ...", flush=True)
            proc = start_server(port, engine=args.server_engine, cwd=REPO)
            url = f"http://127.0.0.1:{port}"
        up = MemoUpstream(OpenAIUpstream(url, model=args.model, timeout=3600.0), args.answers)
        model = up.upstream.model
        plain = up  # the no-privacy reference: unperturbed questions, same memo

        # every LLM call up front, all workloads in one batch queue (the server batches them):
        # arm 1 = per-query LDP without a cache, plus one plain ask per distinct problem
        base = PerQueryLDP(up, PrivacyLedger(":memory:", 1e18), mechanism)
        jobs = []
        ex = cf.ThreadPoolExecutor(args.concurrency)
        try:
            for k in kinds:
                wseed = WORKLOADS.index(k)
                for i, x in enumerate(streams[k]):
                    jobs.append(
                        (
                            k,
                            "ldp",
                            i,
                            ex.submit(
                                base.ask,
                                x["text"],
                                seed=[args.seed, wseed, i],
                                max_tokens=max_tokens,
                                temperature=0,
                            ),
                        )
                    )
                for p in sorted({x["problem"] for x in streams[k]}):
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
            for _, _, _, f in tqdm(jobs, desc="LLM calls (memoized ones are instant)", file=sys.stderr):
                f.result()
        finally:  # on SIGTERM/errors: drop the queued calls (the server is stopped below)
            ex.shutdown(wait=False, cancel_futures=True)
        calls_baseline = up.calls
        print(f"LLM calls made in this invocation: {calls_baseline} ({time.time() - t0:.0f} s)", flush=True)

        for k in kinds:
            r = evaluate_workload(
                streams[k],
                problem_sets[k],
                [f.result() for kk, kind, _, f in jobs if kk == k and kind == "ldp"],
                {p: f.result() for kk, kind, p, f in jobs if kk == k and kind == "plain"},
                mechanism=mechanism,
                embedder=embedder,
                upstream=up,
                sched=sched,
                capacity=capacity,
                repeats=repeats,
                seed=args.seed,
                wseed=WORKLOADS.index(k),
                max_tokens=max_tokens,
                sim_threshold=args.sim_threshold,
                progress=lambda it, desc, k=k: tqdm(it, desc=f"{k}: {desc}", file=sys.stderr),
            )
            t1 = time.time()
            r["sweep"] = sweep(
                k,
                problem_sets[k],
                visits_of[k],
                mechanism,
                embedder,
                sched,
                workload_seeds=range(args.seed, args.seed + sweep_seeds),
                capacities=caps,
                repeats=sweep_repeats,
                seed=args.seed,
            )
            r["sweep_seconds"] = round(time.time() - t1, 1)
            r["pool"] = sizes[k]
            results[k] = r
        extra_calls = up.calls - calls_baseline
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    where = f"at {args.upstream}" if args.upstream else f"behind llmkit serve ({args.server_engine} engine)"
    if args.answers is not None and up.calls == 0:
        where = f"(every answer replayed from {args.answers}; no LLM call in this invocation)"
    print(
        f"model: {model} {where}; capacity {capacity}; eps/token "
        f"{args.epsilon_per_token:g}; rr eps {args.rr_epsilon:g}; {max_tokens} answer tokens; {repeats} "
        f"scheduler seeds per cache arm"
    )
    figures: dict = {}
    for k in kinds:
        r = results[k]
        arms = r["arms"]
        nc, mf, lru = arms["no_cache"], arms["ldpcache_multifactor"], arms["ldpcache_lru"]
        saving = 1.0 - mf["epsilon_per_query"] / nc["epsilon_per_query"]
        print(
            f"[{k}] epsilon per answered query: no cache {nc['epsilon_per_query']:.1f}, "
            f"LDPCache {mf['epsilon_per_query']:.1f} -> budget_saving {saving:.3f}"
        )
        print(
            f"[{k}] accuracy ({'one-step arithmetic from GSM8K' if k.endswith('_arith') else 'GSM8K'}, same "
            f"model, same perturbed queries; {r['queries']} queries): no cache "
            f"{nc['accuracy']:.3f}, LDPCache {mf['accuracy']:.3f}, LRU {lru['accuracy']:.3f}; no privacy "
            f"(plain ask per problem) {r['accuracy_plain_queries']:.3f} per query, "
            f"{r['accuracy_plain_problems']:.3f} per problem ({r['problems']} problems)"
        )
        print(
            f"[{k}] agreement with the no-privacy answer (same final number as the plain ask): no cache "
            f"{nc['agreement']:.3f}, LDPCache {mf['agreement']:.3f}, LRU {lru['agreement']:.3f}"
        )
        print(
            f"[{k}] where accuracy differs (only hits can differ; mean over scheduler seeds): LDPCache hits "
            f"{mf['hits']:.1f} of {r['queries']}, correct {mf['hits_correct']:.1f} with the cached answer vs "
            f"{mf['hits_correct_no_cache']:.1f} with the no-cache arm's own answer to the same queries; one "
            f"wrong cached answer served up to {mf['max_hits_per_wrong_answer']:.1f} hits"
        )
        bs = r["accuracy_diff_vs_no_cache"]
        print(
            f"[{k}] accuracy difference vs no cache (95% interval, bootstrap over the {bs['ldpcache_lru']['problems']} "
            "problems): "
            + "; ".join(
                f"{label} {bs[name]['diff']:+.3f} [{bs[name]['ci95'][0]:+.3f}, {bs[name]['ci95'][1]:+.3f}]"
                for label, name in (("LDPCache", "ldpcache_multifactor"), ("LRU", "ldpcache_lru"))
            )
            + f"; LDPCache non-inferior at margin {MARGIN} (lower bound >= -{MARGIN}): "
            + ("yes" if noninferior(bs["ldpcache_multifactor"]["ci95"]) else "no")
        )
        print(
            f"[{k}] hit ratio at capacity {capacity} ({repeats} scheduler seeds): multi-factor "
            f"{mf['hit_ratio']:.3f} (min {mf['hit_ratio_min']:.3f}, max {mf['hit_ratio_max']:.3f}), LRU "
            f"{lru['hit_ratio']:.3f} (min {lru['hit_ratio_min']:.3f}, max {lru['hit_ratio_max']:.3f}), unbounded "
            f"{arms['ldpcache_unbounded']['hit_ratio']:.3f}, GPTCache threshold (not private) "
            f"{arms['gptcache_threshold']['hit_ratio']:.3f}; false hits {mf['false_hit_rate']:.3f}"
        )
        for cap, c in r["sweep"].items():
            print(
                f"[{k}] sweep capacity {cap} ({c['diff']['n']} runs = {sweep_seeds} workload seeds x "
                f"{sweep_repeats} scheduler seeds): multi-factor {c['multifactor']['mean']:.3f} +- "
                f"{c['multifactor']['std']:.3f}, LRU {c['lru']['mean']:.3f} +- {c['lru']['std']:.3f}; "
                f"paired diff {c['diff']['mean']:+.3f} (se {c['diff']['se']:.3f}), multi-factor higher in "
                f"{c['share_multifactor_higher']:.0%}, equal in {c['share_equal']:.0%}"
            )
        if k in ("uniform", "zipf"):
            sfx = "" if k == "zipf" or "zipf" not in kinds else "_" + k
        else:
            sfx = "_" + k
        figures.update(
            {
                f"budget_saving{sfx}": round(saving, 4),
                f"accuracy_cache{sfx}": round(mf["accuracy"], 4),
                f"accuracy_no_cache{sfx}": round(nc["accuracy"], 4),
                f"hit_ratio_multifactor{sfx}": round(mf["hit_ratio"], 4),
                f"hit_ratio_lru{sfx}": round(lru["hit_ratio"], 4),
                f"accuracy_lru{sfx}": round(lru["accuracy"], 4),
                f"agreement_no_cache{sfx}": round(nc["agreement"], 4),
                f"agreement_cache{sfx}": round(mf["agreement"], 4),
                f"agreement_lru{sfx}": round(lru["agreement"], 4),
                f"accuracy_plain_no_privacy{sfx}": round(r["accuracy_plain_queries"], 4),
                f"accuracy_diff_cache_ci95{sfx}": [
                    round(x, 4) for x in r["accuracy_diff_vs_no_cache"]["ldpcache_multifactor"]["ci95"]
                ],
                f"accuracy_noninferior{sfx}": noninferior(bs["ldpcache_multifactor"]["ci95"]),
                f"accuracy_on_hits_cache{sfx}": round(mf["hits_correct"] / mf["hits"], 4)
                if mf["hits"]
                else None,
                f"accuracy_on_hits_no_cache{sfx}": round(mf["hits_correct_no_cache"] / mf["hits"], 4)
                if mf["hits"]
                else None,
                f"budget_saving_lru{sfx}": round(1.0 - lru["epsilon_per_query"] / nc["epsilon_per_query"], 4),
                f"hit_ratio_gptcache_not_private{sfx}": round(arms["gptcache_threshold"]["hit_ratio"], 4),
                f"hit_ratio_unbounded{sfx}": round(arms["ldpcache_unbounded"]["hit_ratio"], 4),
                f"false_hit_rate_cache{sfx}": round(mf["false_hit_rate"], 4),
                f"sweep_hit_ratio_diff_mean{sfx}": round(
                    sum(c["diff"]["mean"] for c in r["sweep"].values()) / len(r["sweep"]), 4
                ),
            }
        )
    if len(kinds) > 1:  # the workloads' problems together: one interval for the whole run
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
        print(
            f"[pooled: {', '.join(kinds)}] accuracy difference LDPCache - no cache over "
            f"{sum(len(streams[k]) for k in kinds)} queries, {pooled['problems']} problems: "
            f"{pooled['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]; non-inferior at margin {MARGIN}: "
            f"{'yes' if noninferior(pooled['ci95']) else 'no'}"
        )
        figures["accuracy_diff_pooled"] = round(pooled["diff"], 4)
        figures["accuracy_diff_pooled_ci95"] = [round(lo, 4), round(hi, 4)]
        figures["accuracy_noninferior_pooled"] = noninferior(pooled["ci95"])
    if "zipf" in kinds:
        figures["workload"] = "zipf (unsuffixed keys); uniform keys end in _uniform"
    print(
        f"LLM calls {calls_baseline} (+{extra_calls} beyond the baseline's and the plain asks); "
        f"{time.time() - t0:.0f} s"
    )

    fb_section, fb_figures = fixed_budget_section(args, embedder, capacity, max_tokens, OpenAIUpstream, mechanism)
    write_fixed_budget(fb_section, q, args.fixed_budget_out)
    figures.update(fb_figures)

    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    arith = [k.endswith("_arith") for k in kinds]
    stem = (
        "ldp_cache" + ("_arith" if all(arith) else "_mixed" if any(arith) else "") + ("_quick" if q else "")
    )
    result = {
        "figures": figures,
        "workloads": results,
        "model": model,
        "capacity": capacity,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "visits": {k: visits_of[k] for k in kinds},
        "max_tokens": max_tokens,
        "repeats": repeats,
        "zipf_s": ZIPF_S,
        "sweep": {"workload_seeds": sweep_seeds, "scheduler_seeds": sweep_repeats, "capacities": caps},
        "mechanism": mechanism.name,
        "workload_description": __doc__.split("Workloads")[1].split("Pipeline")[0].strip(),
        "fixed_budget": {k: v for k, v in fb_section.items() if k != "curves"},
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / (stem + '.json')} and {stem}.png")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
