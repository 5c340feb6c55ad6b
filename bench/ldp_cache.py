"""LDPCache benchmark: privacy budget per answered query, accuracy, and eviction hit ratios.

Paper: LDPCache (../shared/seeds/004_ead6308da16bc4ed.txt). Anchors measured in the same run:
per-query LDP without a cache (budget, accuracy), LRU eviction at the same capacity (hit
ratio), and a GPTCache-style similarity-threshold cache (hit ratio; its decision is not
private, so it is a reference only).

Workload (from GSM8K train, ../shared/data/gsm8k/train.jsonl)
    A user works through a handful of short GSM8K problems (at most two calculator steps,
    at most 45 words, sampled with a fixed seed) and keeps coming back to them. The stream
    is a sequence of *visits*; a visit is 2-4 consecutive queries that are templated
    variants of one problem (the same question wrapped as "Solve this math word problem:
    ...", "... Think step by step.", "I need help with my homework. ...", etc.; the answer
    never changes). Each visit after the first returns to an earlier problem with
    probability 0.5, else takes a new one. Consecutive queries are therefore semantically
    correlated (same problem), and earlier problems recur after others were asked, which
    is what a small edge cache has to remember.

Pipeline
    The bundled model is served by ``llmkit serve`` (started here as a subprocess). Every
    query sent upstream is perturbed by the token exponential mechanism (eps per word piece,
    so a query costs eps x its length). The no-cache baseline sends every query. LDPCache
    sends only its misses; a hit costs the randomized-response bit (rr-epsilon).
    Common random numbers: query i is perturbed with seed i in every run, so a cache miss
    on query i sends exactly the text the baseline sent for query i, and the (greedy)
    upstream answer is reused from the baseline's call. Both arms are thus judged on the
    same perturbed texts and the same model answers; the LLM is called once per query in
    total. The cache runs are repeated over several seeds of the scheduler's coin (which
    needs no new LLM calls) and averaged.

Accuracy: the last number in the answer equals the GSM8K answer. SmolLM2-135M is weak on
GSM8K, so accuracies are low; both arms use the same model and the same queries.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

TEMPLATES = [
    "{q}",
    "Solve this math word problem: {q}",
    "{q} Think step by step.",
    "Question: {q}\nAnswer:",
    "I need help with my homework. {q}",
    "{q} Give the final answer as a number.",
    "Please work out the following. {q}",
    "Here is a word problem for you. {q} What is the answer?",
]


def load_problems(path: Path, n: int, seed: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                gold = r["answer"].split("####")[-1].strip().replace(",", "")
                float(gold)
            except (ValueError, KeyError) as e:
                sys.exit(f"{path}:{line_no}: not a GSM8K record ({e})")
            if r["answer"].count("<<") <= 2 and len(r["question"].split()) <= 45:
                rows.append({"question": r["question"], "gold": gold})
    random.Random(seed).shuffle(rows)
    return rows[:n]


def build_workload(problems: list[dict], visits: int, seed: int, p_revisit: float = 0.5) -> list[dict]:
    rng = random.Random(seed)
    seen: list[int] = []
    queries = []
    nxt = 0
    for v in range(visits):
        revisit = seen and (nxt >= len(problems) or rng.random() < p_revisit)
        if revisit:
            cur = queries[-1]["problem"] if queries else -1
            choices = [p for p in seen if p != cur] or seen
            pid = rng.choice(choices)
        else:
            pid = nxt
            nxt += 1
            seen.append(pid)
        for t in rng.sample(range(len(TEMPLATES)), rng.randint(2, 4)):
            queries.append({"problem": pid, "visit": v, "template": t,
                            "text": TEMPLATES[t].format(q=problems[pid]["question"]),
                            "gold": problems[pid]["gold"]})
    return queries


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return nums[-1] if nums else None


def correct(text: str, gold: str) -> bool:
    x = last_number(text)
    return x is not None and abs(float(x) - float(gold)) < 1e-6


class MemoUpstream:
    """Calls the server once per distinct (messages, params); later identical calls are replayed."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.memo: dict[str, str] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, messages, **params):
        key = json.dumps([messages, params], sort_keys=True)
        with self.lock:
            if key in self.memo:
                return self.memo[key]
        text = self.upstream(messages, **params)
        with self.lock:
            self.calls += 1
            self.memo[key] = text
        return text


class MemoEmbedder:
    def __init__(self, embedder):
        self.embedder, self.memo = embedder, {}

    def __call__(self, texts):
        import numpy as np

        todo = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if todo:
            for t, v in zip(todo, self.embedder(todo)):
                self.memo[t] = v
        return np.stack([self.memo[t] for t in texts])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, timeout: float = 600.0):
    import httpx

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "llmkit.cli", "serve", "--port", str(port),
                             "--log-level", "warning", "--threads", "1"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


def run_cache(queries, mechanism, embedder, upstream, *, capacity, policy, scheduler, seed, bit_seed,
              max_tokens):
    from llmkit.serving.ldp_cache import CacheStore, LDPCache, PrivacyLedger, make_policy

    cache = LDPCache(upstream, PrivacyLedger(":memory:", 1e18), CacheStore(capacity=capacity,
                     policy=make_policy(policy)), mechanism, embedder, scheduler)
    rows = []
    owner: dict[str, int] = {}  # response text -> problem whose query produced it
    for i, q in enumerate(queries):
        a = cache.ask(q["text"], seed=[seed, i], bit_seed=[bit_seed, i], max_tokens=max_tokens, temperature=0)
        if not a.cache_hit:
            owner.setdefault(a.text, q["problem"])
        rows.append({"hit": a.cache_hit, "epsilon": a.epsilon, "correct": correct(a.text, q["gold"]),
                     "wrong_problem": a.cache_hit and owner.get(a.text, q["problem"]) != q["problem"]})
    n = len(rows)
    return {"hit_ratio": sum(r["hit"] for r in rows) / n,
            "epsilon_per_query": sum(r["epsilon"] for r in rows) / n,
            "accuracy": sum(r["correct"] for r in rows) / n,
            "false_hit_rate": sum(r["wrong_problem"] for r in rows) / n}


def mean_runs(runs: list[dict]) -> dict:
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    out["hit_ratio_min"] = min(r["hit_ratio"] for r in runs)
    out["hit_ratio_max"] = max(r["hit_ratio"] for r in runs)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = ["no_cache", "ldpcache_multifactor", "ldpcache_lru", "gptcache_threshold"]
    labels = ["per-query LDP", "LDPCache\nmulti-factor", "LDPCache\nLRU", "GPTCache\n(not private)"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, title in zip(axes, ["epsilon_per_query", "accuracy", "hit_ratio"],
                              ["epsilon per answered query", "accuracy (GSM8K)", "hit ratio"]):
        ax.bar(labels, [result["arms"][a].get(key, 0.0) for a in arms], color=["grey", "C0", "C1", "C2"])
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workload (about 2-3 minutes)")
    ap.add_argument("--problems", type=int, default=None, help="distinct GSM8K problems (quick 6, full 20)")
    ap.add_argument("--visits", type=int, default=None, help="visits (2-4 variants each; quick 12, full 45)")
    ap.add_argument("--capacity", type=int, default=None, help="cache entries (quick 3, full 8)")
    ap.add_argument("--epsilon-per-token", type=float, default=38.0)
    ap.add_argument("--rr-epsilon", type=float, default=3.0)
    ap.add_argument("--sim-threshold", type=float, default=0.8)
    ap.add_argument("--gain-threshold", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=None, help="answer length (quick 64, full 192)")
    ap.add_argument("--repeats", type=int, default=None, help="scheduler-coin seeds per cache arm (quick 5, full 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--upstream", default=None, help="use a running OpenAI-compatible server instead of "
                    "starting `llmkit serve`")
    args = ap.parse_args(argv)
    q = args.quick
    problems_n = args.problems or (6 if q else 20)
    visits = args.visits or (12 if q else 45)
    capacity = args.capacity or (3 if q else 8)
    max_tokens = args.max_tokens or (64 if q else 192)
    repeats = args.repeats or (5 if q else 20)
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
        ThresholdScheduler,
    )
    from llmkit.serving.ldp_cache.embedder import MiniLMEmbedder

    problems = load_problems(args.data, problems_n, args.seed)
    queries = build_workload(problems, visits, args.seed)
    n = len(queries)
    print(f"workload: {n} queries, {len({x['problem'] for x in queries})} GSM8K train problems, "
          f"{visits} visits of 2-4 templated variants, revisit probability 0.5", flush=True)

    t0 = time.time()
    mechanism = ExponentialTokenMechanism.from_minilm(args.epsilon_per_token)
    embedder = MemoEmbedder(MiniLMEmbedder())
    proc = None
    try:
        if args.upstream:
            url = args.upstream
        else:
            port = free_port()
            print(f"starting llmkit serve on port {port} ...", flush=True)
            proc = start_server(port)
            url = f"http://127.0.0.1:{port}"
        up = MemoUpstream(OpenAIUpstream(url, timeout=3600.0))
        model = up.upstream.model

        # arm 1: per-query LDP, no cache (every query perturbed and sent; calls run concurrently so
        # the server can batch them)
        base = PerQueryLDP(up, PrivacyLedger(":memory:", 1e18), mechanism)
        with cf.ThreadPoolExecutor(16) as ex:
            futs = [ex.submit(base.ask, x["text"], seed=[args.seed, i], max_tokens=max_tokens, temperature=0)
                    for i, x in enumerate(queries)]
            answers = [f.result() for f in tqdm(futs, desc="no-cache LDP queries", file=sys.stderr)]
        no_cache = {"hit_ratio": 0.0, "epsilon_per_query": sum(a.epsilon for a in answers) / n,
                    "accuracy": sum(correct(a.text, x["gold"]) for a, x in zip(answers, queries)) / n,
                    "false_hit_rate": 0.0}
        calls_baseline = up.calls

        # a reference without privacy: each problem asked once, plainly
        plain = OpenAIUpstream(url, timeout=3600.0)
        with cf.ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(lambda p: plain([{"role": "user", "content": p["question"]}],
                                               max_tokens=max_tokens, temperature=0), problems))
        acc_plain = sum(correct(o, p["gold"]) for o, p in zip(outs, problems)) / len(problems)

        # arms 2-4: caches at the same capacity, coupled to arm 1's perturbations (no new LLM calls)
        def sched():
            return LDPScheduler(args.rr_epsilon, args.sim_threshold, args.gain_threshold)

        arms = {"no_cache": no_cache}
        for name, policy in (("ldpcache_multifactor", "multifactor"), ("ldpcache_lru", "lru")):
            runs = [run_cache(queries, mechanism, embedder, up, capacity=capacity, policy=policy,
                              scheduler=sched(), seed=args.seed, bit_seed=1000 + r, max_tokens=max_tokens)
                    for r in tqdm(range(repeats), desc=f"cache runs ({policy})", file=sys.stderr)]
            arms[name] = mean_runs(runs)
        arms["ldpcache_unbounded"] = mean_runs([
            run_cache(queries, mechanism, embedder, up, capacity=10**6, policy="lru", scheduler=sched(),
                      seed=args.seed, bit_seed=1000 + r, max_tokens=max_tokens) for r in range(repeats)])
        arms["gptcache_threshold"] = run_cache(queries, mechanism, embedder, up, capacity=capacity, policy="lru",
                                               scheduler=ThresholdScheduler(args.sim_threshold), seed=args.seed,
                                               bit_seed=0, max_tokens=max_tokens)
        extra_calls = up.calls - calls_baseline
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()

    mf, lru = arms["ldpcache_multifactor"], arms["ldpcache_lru"]
    saving = 1.0 - mf["epsilon_per_query"] / no_cache["epsilon_per_query"]
    figures = {
        "budget_saving": round(saving, 4),
        "accuracy_cache": round(mf["accuracy"], 4),
        "accuracy_no_cache": round(no_cache["accuracy"], 4),
        "hit_ratio_multifactor": round(mf["hit_ratio"], 4),
        "hit_ratio_lru": round(lru["hit_ratio"], 4),
        "budget_saving_lru": round(1.0 - lru["epsilon_per_query"] / no_cache["epsilon_per_query"], 4),
        "accuracy_lru": round(lru["accuracy"], 4),
        "hit_ratio_gptcache_not_private": round(arms["gptcache_threshold"]["hit_ratio"], 4),
        "hit_ratio_unbounded": round(arms["ldpcache_unbounded"]["hit_ratio"], 4),
        "false_hit_rate_cache": round(mf["false_hit_rate"], 4),
        "accuracy_plain_no_privacy": round(acc_plain, 4),
        "epsilon_per_query_no_cache": round(no_cache["epsilon_per_query"], 2),
        "epsilon_per_query_cache": round(mf["epsilon_per_query"], 2),
    }
    print(f"model: {model} behind llmkit serve; {n} queries; capacity {capacity}; eps/token "
          f"{args.epsilon_per_token:g}; rr eps {args.rr_epsilon:g}; {repeats} scheduler seeds per cache arm")
    print(f"epsilon per answered query: no cache {no_cache['epsilon_per_query']:.1f}, "
          f"LDPCache {mf['epsilon_per_query']:.1f} -> budget_saving {saving:.3f}")
    print(f"accuracy (GSM8K, same model, same perturbed queries): no cache {no_cache['accuracy']:.3f}, "
          f"LDPCache {mf['accuracy']:.3f}, LRU {lru['accuracy']:.3f}; no privacy (one plain ask per problem) "
          f"{acc_plain:.3f}")
    print(f"hit ratio at capacity {capacity}: multi-factor {mf['hit_ratio']:.3f} "
          f"(min {mf['hit_ratio_min']:.3f}, max {mf['hit_ratio_max']:.3f}), LRU {lru['hit_ratio']:.3f} "
          f"(min {lru['hit_ratio_min']:.3f}, max {lru['hit_ratio_max']:.3f}), unbounded "
          f"{arms['ldpcache_unbounded']['hit_ratio']:.3f}, GPTCache threshold (not private) "
          f"{arms['gptcache_threshold']['hit_ratio']:.3f}")
    print(f"false hits (answered with another problem's response): {mf['false_hit_rate']:.3f}; "
          f"LLM calls {calls_baseline} (+{extra_calls} beyond the baseline's); {time.time() - t0:.0f} s")

    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "ldp_cache_quick" if q else "ldp_cache"
    result = {"figures": figures, "arms": arms, "model": model, "queries": n, "capacity": capacity,
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "problems": problems_n, "visits": visits, "max_tokens": max_tokens, "repeats": repeats,
              "mechanism": mechanism.name, "workload": __doc__.split("Workload")[1].split("Pipeline")[0].strip(),
              "sample_queries": [x["text"] for x in queries[:4]]}
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(result, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / (stem + '.json')} and {stem}.png")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
