"""LDPCache benchmark machinery: memoized upstream/embedder/mechanism, cache runs over a stream,
hit-ratio sweeps and eviction ablations, and the problem-level bootstrap.

Used by ``bench/ldp_cache.py`` (see its docstring for the experimental design) and tested in
``tests/test_ldp_bench_workload.py``. Nothing here starts a model except :func:`start_server`.

Common random numbers: :func:`run_cache` perturbs query i with the seed ``[*seed, i]``, so a cache
miss sends exactly the text the no-cache arm sent for query i and the memoized upstream replays
its answer; arms differ only where the cache answers.

Bootstrap: the unit of resampling is the *problem* (a cached answer is reused across a problem's
queries, so queries are not independent); :func:`problem_bootstrap` resamples problems with
replacement with ``scipy.stats.bootstrap`` (paired, percentile interval) over the statistic
sum(a - b) / sum(queries).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from .workload import build, correct, last_number

MARGIN = 0.05  # non-inferiority margin for "equal accuracy", fixed before the large arithmetic run


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, timeout: float = 600.0, engine: str = "hf", cwd: str | Path | None = None):
    """Start ``llmkit serve`` with the bundled model on ``port`` and wait until it is healthy."""
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmkit.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *(["--threads", "1"] if engine == "hf" else ["--engine", "vllm", "--enforce-eager"]),
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llmkit serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("llmkit serve did not become healthy in time")


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
    from . import CacheStore, LDPCache, PrivacyLedger, make_policy

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


def summary_stats(xs: list[float]) -> dict:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": m, "std": sd, "min": min(xs), "max": max(xs), "n": len(xs)}


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
        d = summary_stats(diff)
        out[str(cap)] = {
            "multifactor": summary_stats(mf),
            "lru": summary_stats(lru),
            "diff": {**d, "se": d["std"] / math.sqrt(d["n"])},
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
    from .store import CacheStore

    class SurvivorMeanStore(CacheStore):
        def cloud_accuracy(self, user):
            entries = self.entries(user)
            return sum(e.accuracy for e in entries) / len(entries) if entries else None

    return SurvivorMeanStore


def eviction_ablation(
    kind, problems, visits, mechanism, embedder, sched, *, workload_seeds, capacities, repeats, seed
):
    """Hit ratio of each policy in ABLATION, paired with LRU on the same streams (stand-in upstream)."""
    from .eviction import MultiFactorPolicy

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
            d = summary_stats([a - b for a, b in zip(xs, hits["lru"])])
            cell[name] = {**summary_stats(xs), "diff_vs_lru": d["mean"], "diff_se": d["std"] / math.sqrt(d["n"])}
        out[str(cap)] = cell
    return out




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
    from .scheduler import ThresholdScheduler

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
