"""LDPCache benchmark runs: memoized upstream/embedder/mechanism, cache runs over a stream, the
equal-epsilon evaluation of every arm, hit-ratio sweeps, eviction ablations and the problem bootstrap.

Common random numbers: :func:`run_cache` perturbs query i with the seed ``[*seed, i]``, so a cache miss
sends exactly the text the no-cache arm sent for query i and the memoized upstream replays its answer;
arms differ only where the cache answers, and the LLM is called once per query in all (plus one plain,
unperturbed ask per problem for the no-privacy reference). The cache arms are repeated over seeds of the
scheduler's coin (no new LLM calls) and averaged; min and max are kept.

Hit-ratio sweep and ablation (no LLM calls): hits do not depend on the response texts (the scheduler
sees raw-query embeddings and the fidelity of the perturbed query), so they are simulated exactly with a
stand-in upstream that returns "". Each cell pairs a policy with LRU on the same stream and scheduler
seed. The workload seeds are held out from those the multi-factor weights were tuned on. The ablation
removes factors, adds the frequency factor, and tries session 2's scheduler input (E[acc | cloud] over
the surviving entries only, which made the hit test depend on the eviction policy).

"Equal or better accuracy" is judged as non-inferiority with a margin (MARGIN) fixed before the large
run: the lower end of the 95% interval of accuracy(LDPCache) - accuracy(no cache) must be >= -MARGIN.
Not a better point estimate: in expectation a reused answer (produced for another perturbed variant of
the same question) is as likely right as the no-cache one, so the estimate lands on either side of 0.

Bootstrap: the unit of resampling is the *problem* (a cached answer is reused across a problem's
queries, so queries are not independent); :func:`problem_bootstrap` resamples problems with
``scipy.stats.bootstrap`` (paired, percentile) over the ratio sum(a - b) / sum(queries), and also reports
the share of resamples below 0, which ``llmkit.experiments.stats.bootstrap_ci`` does not expose.

The JSONL answer memo (:class:`MemoUpstream`) stays rather than ``harness.KeyedCache``: it is filled one
call at a time from a thread pool (KeyedCache makes values in batches per arm), and the committed answer
files (bench/results/ldp_cache_parts/*.jsonl.gz) replay earlier runs in this format.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from llmkit.experiments.harness import ServeProcess
from llmkit.experiments.stats import mean_ci
from llmkit.serving.ldp_cache import (
    CacheStore,
    LDPCache,
    MultiFactorPolicy,
    PrivacyLedger,
    ThresholdScheduler,
    make_policy,
)

from .workload import build, correct, last_number

MARGIN = 0.05  # non-inferiority margin for "equal accuracy", fixed before the large arithmetic run


def say(msg: str) -> None:
    """Progress lines go out at once (the benches run for hours, often under ``tee``)."""
    print(msg, flush=True)


@contextmanager
def served(url: str | None, engine: str = "hf", cwd=None) -> Iterator[str]:
    """``url`` itself, or ``llmkit serve`` with the bundled model started for the body (hf: one thread;
    vllm: eager), stopped on the way out."""
    if url:
        yield url
        return
    args = ["--threads", "1"] if engine == "hf" else ["--engine", "vllm", "--enforce-eager"]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with ServeProcess(args, env=env, cwd=cwd) as srv:
        yield srv.url


def open_text(path: Path, mode: str):
    """A text file, gzip-compressed if its name ends in .gz (appends add gzip members)."""
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


class MemoUpstream:
    """Calls the server once per distinct (messages, params); later identical calls are replayed.

    With ``path``, answers are appended to a JSONL file (.jsonl.gz: compressed) and loaded from
    it on start (resume).
    """

    def __init__(self, upstream, path: Path | None = None):
        self.upstream = upstream
        self.memo: dict[str, str] = {}
        self.calls = 0
        self.lock = threading.Lock()
        self.path = path
        if path is not None and path.is_file():
            with open_text(path, "rt") as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        self.memo[r["key"]] = r["text"]

    def __call__(self, messages, **params):
        key = json.dumps([messages, params], sort_keys=True)
        with self.lock:
            if key in self.memo:
                return self.memo[key]
        text = self.upstream(messages, **params)
        with self.lock:
            self.calls += 1
            self.memo[key] = text
            if self.path is not None:
                with open_text(self.path, "at") as f:
                    f.write(json.dumps({"key": key, "text": text}) + "\n")
        return text


def stub_upstream(messages, **params) -> str:
    """For hit-ratio simulation: hits never depend on the response text."""
    return ""


class MemoEmbedder:
    def __init__(self, embedder):
        self.embedder, self.memo = embedder, {}

    def __call__(self, texts):
        todo = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if todo:
            for t, v in zip(todo, self.embedder(todo)):
                self.memo[t] = v
        return np.stack([self.memo[t] for t in texts])


class MemoMechanism:
    """The token mechanism with its draws memoized by (text, generator state).

    The client derives a fresh generator from the query's seed for every perturbation, so
    the state before the draw identifies the draw; replaying it is exact and saves the
    30k-way sampling in the repeated simulation runs.
    """

    def __init__(self, mechanism):
        self.mechanism, self.memo = mechanism, {}
        self.name = getattr(mechanism, "name", type(mechanism).__name__)

    def __getattr__(self, name):
        return getattr(self.mechanism, name)

    def perturb(self, text, rng, epsilon=None):
        key = (text, epsilon, json.dumps(rng.bit_generator.state, sort_keys=True, default=str))
        out = self.memo.get(key)
        if out is None:
            out = self.memo[key] = self.mechanism.perturb(text, rng, epsilon=epsilon)
        return out


def run_cache(
    queries,
    mechanism,
    embedder,
    upstream,
    *,
    capacity,
    policy,
    scheduler,
    seed,
    bit_seed,
    max_tokens,
    score=True,
    store_cls=None,
):
    """One pass of an LDPCache over the stream. ``seed`` is the perturbation seed prefix (CRN)."""
    cache = LDPCache(
        upstream,
        PrivacyLedger(":memory:", 1e18),
        (store_cls or CacheStore)(
            capacity=capacity, policy=make_policy(policy) if isinstance(policy, str) else policy()
        ),
        mechanism,
        embedder,
        scheduler,
    )
    rows = []
    owner: dict[str, int] = {}  # response text -> problem whose query produced it
    for i, q in enumerate(queries):
        a = cache.ask(
            q["text"], seed=[*seed, i], bit_seed=[bit_seed, i], max_tokens=max_tokens, temperature=0
        )
        if not a.cache_hit:
            owner.setdefault(a.text, q["problem"])
        rows.append(
            {
                "hit": a.cache_hit,
                "epsilon": a.epsilon,
                "correct": score and correct(a.text, q["gold"]),
                "agree": score and correct(a.text, q.get("ref")),
                "wrong_problem": score and a.cache_hit and owner.get(a.text, q["problem"]) != q["problem"],
                # the no-cache arm's answer to this same query (same perturbed text), when known
                "no_cache_correct": bool(q.get("no_cache_correct")),
                "text": a.text,
            }
        )
    n = len(rows)
    hits = [r for r in rows if r["hit"]]
    wrong_reuse = Counter(r["text"] for r in hits if score and not r["correct"])
    return {
        "hit_ratio": sum(r["hit"] for r in rows) / n,
        "epsilon_per_query": sum(r["epsilon"] for r in rows) / n,
        "accuracy": sum(r["correct"] for r in rows) / n,
        "agreement": sum(r["agree"] for r in rows) / n,
        "false_hit_rate": sum(r["wrong_problem"] for r in rows) / n,
        # accuracy differences come only from hits (a miss sends the no-cache arm's text, CRN):
        "hits": len(hits),
        "hits_correct": sum(r["correct"] for r in hits),
        "hits_correct_no_cache": sum(r["no_cache_correct"] for r in hits),
        # most hits answered with one and the same wrong cached answer
        "max_hits_per_wrong_answer": max(wrong_reuse.values(), default=0),
        "correct_per_problem": dict(Counter(q["problem"] for q, r in zip(queries, rows) if r["correct"])),
    }


def mean_runs(runs: list[dict]) -> dict:
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "correct_per_problem"}
    pids = {p for r in runs for p in r["correct_per_problem"]}
    out["correct_per_problem"] = {
        p: sum(r["correct_per_problem"].get(p, 0) for r in runs) / len(runs) for p in pids
    }
    out["hit_ratio_min"] = min(r["hit_ratio"] for r in runs)
    out["hit_ratio_max"] = max(r["hit_ratio"] for r in runs)
    out["hit_ratio_runs"] = [round(r["hit_ratio"], 4) for r in runs]
    return out


def problem_bootstrap(queries: dict, a: dict, b: dict, draws: int = 4000, seed: int = 0) -> dict:
    """Accuracy difference (a - b) with a 95% interval from resampling *problems* with replacement.

    ``queries[p]`` = queries about problem p, ``a[p]`` / ``b[p]`` = correct answers among them. All
    arms share one set of model answers, so the problems (not the scheduler seeds) are the unit of
    sampling: a problem's queries are not independent (a cached answer is reused across them).
    ``scipy.stats.bootstrap`` (paired, percentile) resamples the problems.
    """
    from scipy.stats import bootstrap

    pids = sorted(queries)
    n = np.array([queries[p] for p in pids], float)
    d = np.array([a.get(p, 0) - b.get(p, 0) for p in pids], float)

    def diff(nn, dd, axis=-1):
        return dd.sum(axis=axis) / nn.sum(axis=axis)

    point = float(diff(n, d))
    if len(pids) < 2 or np.all(d == d[0]) and np.all(n == n[0]):  # a degenerate (constant) resample
        return {"diff": point, "ci95": [point, point], "share_below_0": float(point < 0), "problems": len(pids)}
    res = bootstrap((n, d), diff, paired=True, vectorized=True, n_resamples=draws, confidence_level=0.95,
                    method="percentile", random_state=np.random.default_rng(seed))
    return {
        "diff": point,
        "ci95": [float(res.confidence_interval.low), float(res.confidence_interval.high)],
        "share_below_0": float(np.mean(res.bootstrap_distribution < 0)),
        "problems": len(pids),
    }


def pooled_bootstrap(per_workload: dict[str, tuple[dict, dict, dict]], **kw) -> dict:
    """:func:`problem_bootstrap` over several workloads' problems at once.

    ``per_workload[k] = (queries, a, b)`` as for :func:`problem_bootstrap`; a problem is the
    unit within its workload (workloads that share a problem id are still separate units).
    """
    counts, a, b = {}, {}, {}
    for k, (queries, ak, bk) in per_workload.items():
        counts.update({(k, p): n for p, n in queries.items()})
        a.update({(k, p): n for p, n in ak.items()})
        b.update({(k, p): n for p, n in bk.items()})
    return problem_bootstrap(counts, a, b, **kw)


def noninferior(ci95) -> bool:
    """The accuracy criterion: the interval's lower end is within MARGIN below 0."""
    return ci95[0] >= -MARGIN


def spread(xs: list[float]) -> dict:
    """``{mean, std, min, max, n}`` (sample std; 0 for one value), the keys the sweep's JSON has always had."""
    c = mean_ci(xs)
    return {"mean": c["mean"], "std": c["std"], "min": min(xs), "max": max(xs), "n": c["n"]}


def paired_spread(diffs: list[float]) -> dict:
    """:func:`spread` of paired differences plus the standard error of their mean (``se``)."""
    d = spread(diffs)
    return {**d, "se": d["std"] / math.sqrt(d["n"])}


def sweep(kind, problems, visits, mechanism, embedder, sched, *, workload_seeds, capacities, repeats, seed):
    """Hit ratios (multi-factor vs LRU), paired per (workload seed, scheduler seed), stand-in upstream."""
    out = {}
    for cap in capacities:
        mf, lru, diff = [], [], []
        for ws in workload_seeds:
            queries = build(kind, problems, visits, ws)
            for r in range(repeats):
                kw = {
                    "capacity": cap,
                    "scheduler": sched(),
                    "seed": [seed, 1000 + ws],
                    "bit_seed": 1000 + r,
                    "max_tokens": 0,
                    "score": False,
                }
                a = run_cache(queries, mechanism, embedder, stub_upstream, policy="multifactor", **kw)[
                    "hit_ratio"
                ]
                kw["scheduler"] = sched()
                b = run_cache(queries, mechanism, embedder, stub_upstream, policy="lru", **kw)["hit_ratio"]
                mf.append(a)
                lru.append(b)
                diff.append(a - b)
        out[str(cap)] = {
            "multifactor": spread(mf),
            "lru": spread(lru),
            "diff": paired_spread(diff),
            "share_multifactor_higher": sum(x > 0 for x in diff) / len(diff),
            "share_equal": sum(x == 0 for x in diff) / len(diff),
        }
    return out


ABLATION = {  # eviction policies compared in --eviction-ablation (weights: diversity, accuracy, recency)
    "lru": "lru",
    "multifactor (1,1,1)": "multifactor",
    "no diversity (0,1,1)": {"w_diversity": 0.0},
    "no accuracy (1,0,1)": {"w_accuracy": 0.0},
    "recency only (0,0,1)": {"w_diversity": 0.0, "w_accuracy": 0.0},
    "with frequency (1,1,1)+1": {"w_frequency": 1.0},
    # session 2's scheduler input: E[acc | cloud] = mean accuracy of the entries still cached
    "lru, survivor-mean E[acc|cloud]": ("lru", "survivors"),
    "multifactor, survivor-mean E[acc|cloud]": ("multifactor", "survivors"),
}


def survivor_mean_store():
    """A CacheStore whose E[acc | cloud] is the mean over the entries still cached (session 2's estimator)."""

    class SurvivorMeanStore(CacheStore):
        def cloud_accuracy(self, user):
            entries = self.entries(user)
            return sum(e.accuracy for e in entries) / len(entries) if entries else None

    return SurvivorMeanStore


def eviction_ablation(
    kind, problems, visits, mechanism, embedder, sched, *, workload_seeds, capacities, repeats, seed
):
    """Hit ratio of each policy in ABLATION, paired with LRU on the same streams (stand-in upstream)."""
    out = {}
    for cap in capacities:
        hits: dict[str, list[float]] = {name: [] for name in ABLATION}
        for ws in workload_seeds:
            queries = build(kind, problems, visits, ws)
            for r in range(repeats):
                for name, pol in ABLATION.items():
                    store_cls = None
                    if isinstance(pol, tuple):
                        pol, store_cls = pol[0], survivor_mean_store()
                    policy = pol if isinstance(pol, str) else (lambda kw=pol: MultiFactorPolicy(**kw))
                    hits[name].append(
                        run_cache(
                            queries,
                            mechanism,
                            embedder,
                            stub_upstream,
                            capacity=cap,
                            policy=policy,
                            scheduler=sched(),
                            seed=[seed, 1000 + ws],
                            bit_seed=1000 + r,
                            max_tokens=0,
                            score=False,
                            store_cls=store_cls,
                        )["hit_ratio"]
                    )
        cell = {}
        for name, xs in hits.items():
            d = paired_spread([a - b for a, b in zip(xs, hits["lru"])])
            cell[name] = {**spread(xs), "diff_vs_lru": d["mean"], "diff_se": d["se"]}
        out[str(cap)] = cell
    return out


def run_ablation(kinds, problem_sets: dict, visits: dict, mechanism, embedder, sched, *, capacities: list[int],
                 workload_seeds: int, scheduler_seeds: int, seed: int, config: dict) -> dict:
    """:func:`eviction_ablation` for every workload kind: the content of ldp_cache_eviction_ablation.json."""
    res = {k: eviction_ablation(k, problem_sets[k], visits[k], mechanism, embedder, sched,
                                workload_seeds=range(seed, seed + workload_seeds), capacities=capacities,
                                repeats=scheduler_seeds, seed=seed)
           for k in kinds}
    return {
        "ablation": res,
        "policies": {k: str(v) for k, v in ABLATION.items()},
        "config": config,
        "visits": {k: visits[k] for k in kinds},
        "capacities": capacities,
        "workload_seeds": workload_seeds,
        "scheduler_seeds": scheduler_seeds,
    }


def ablation_lines(result: dict) -> list[str]:
    """One printed line per workload and capacity."""
    n, r = result["workload_seeds"], result["scheduler_seeds"]
    return [f"[{k}] ablation capacity {cap} ({n} workload x {r} scheduler seeds): "
            + "; ".join(f"{name} {c['mean']:.3f} ({c['diff_vs_lru']:+.3f} +- {c['diff_se']:.3f} vs LRU)"
                        for name, c in cell.items())
            for k, per_cap in result["ablation"].items() for cap, cell in per_cap.items()]


def evaluate_workload(queries: list[dict], problems: list[dict], answers: list, plain_text: dict, *, mechanism,
                      embedder, upstream, sched, capacity: int, repeats: int, seed: int, wseed: int,
                      max_tokens: int, sim_threshold: float, progress=None) -> dict:
    """Every arm on one stream at equal epsilon per token, from the no-cache arm's answers (CRN).

    ``answers[i]`` is the no-cache arm's :class:`.client.Answer` to query i (perturbed with the seed
    ``[seed, wseed, i]``), ``plain_text[p]`` the model's answer to problem p asked plainly. The cache
    arms (multi-factor, LRU, unbounded: ``repeats`` scheduler seeds each; GPTCache threshold: one) run
    over the same perturbations, so a miss replays the no-cache answer through ``upstream`` (memoized).
    Marks each query with ``ref`` (the plain answer's number) and ``no_cache_correct``.
    """
    progress = progress or (lambda it, desc: it)
    qs, n = queries, len(queries)
    no_cache = {
        "hit_ratio": 0.0,
        "epsilon_per_query": sum(a.epsilon for a in answers) / n,
        "accuracy": sum(correct(a.text, x["gold"]) for a, x in zip(answers, qs)) / n,
        "false_hit_rate": 0.0,
    }
    plain_ok = {p: correct(t, problems[p]["gold"]) for p, t in plain_text.items()}
    for x in qs:  # the no-privacy answer's final number, for the agreement measure
        x["ref"] = last_number(plain_text[x["problem"]])
    no_cache["agreement"] = sum(correct(a.text, x["ref"]) for a, x in zip(answers, qs)) / n
    for a, x in zip(answers, qs):
        x["no_cache_correct"] = correct(a.text, x["gold"])
    no_cache["correct_per_problem"] = dict(Counter(x["problem"] for x in qs if x["no_cache_correct"]))
    common = {"seed": [seed, wseed], "max_tokens": max_tokens}
    arms = {"no_cache": no_cache}
    for name, policy in (("ldpcache_multifactor", "multifactor"), ("ldpcache_lru", "lru")):
        arms[name] = mean_runs([
            run_cache(qs, mechanism, embedder, upstream, capacity=capacity, policy=policy, scheduler=sched(),
                      bit_seed=1000 + r, **common)
            for r in progress(range(repeats), f"cache runs ({policy})")
        ])
    arms["ldpcache_unbounded"] = mean_runs([
        run_cache(qs, mechanism, embedder, upstream, capacity=10**6, policy="lru", scheduler=sched(),
                  bit_seed=1000 + r, **common)
        for r in range(repeats)
    ])
    arms["gptcache_threshold"] = run_cache(qs, mechanism, embedder, upstream, capacity=capacity, policy="lru",
                                           scheduler=ThresholdScheduler(sim_threshold), bit_seed=0, **common)
    per_problem = dict(Counter(x["problem"] for x in qs))
    return {
        "arms": arms,
        "queries": n,
        "problems": len(plain_ok),
        "accuracy_plain_problems": sum(plain_ok.values()) / len(plain_ok),
        "accuracy_plain_queries": sum(plain_ok[x["problem"]] for x in qs) / n,  # weighted like the stream
        "sample_queries": [x["text"] for x in qs[:4]],
        "accuracy_diff_vs_no_cache": {
            name: problem_bootstrap(per_problem, arms[name]["correct_per_problem"], no_cache["correct_per_problem"])
            for name in ("ldpcache_multifactor", "ldpcache_lru")
        },
        "per_problem": {
            p: {
                "queries": per_problem.get(p, 0),
                "question": problems[p]["question"],
                "gold": problems[p]["gold"],
                "plain_correct": plain_ok[p],
                "correct_no_cache": no_cache["correct_per_problem"].get(p, 0),
                "correct_ldpcache": round(arms["ldpcache_multifactor"]["correct_per_problem"].get(p, 0), 2),
            }
            for p in sorted(plain_ok)
        },
    }
