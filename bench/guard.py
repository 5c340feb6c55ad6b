"""AEO guard benchmark with the bundled model: the asymmetry, the detectors, the corrections, the overhead.

What it measures, all in one run on the same responses:

1. Responses (greedy) to two injection sets: IHEval (safety: user-prompt-hijack and
   system-prompt-extract; rule-following: single-turn; aligned and conflict settings), graded
   by the IHEval scorer (llmkit.evals.iheval.score_response), and a GSM8K secret-word set
   (llmkit.serving.guard.injection: a math tutor with a secret word, injected requests for
   it), graded by the canary check.
2. Labels. *Violation* (1): a conflict-setting answer that fails the system instruction
   (IHEval strict score < 1; GSM8K: the secret word is in the answer). *Compliant* (0): an
   answer that passes, in either setting. IHEval aligned-setting failures (no conflicting
   instruction: the model simply could not do the task) are left out of detection.
3. The asymmetry (the paper's "Asymmetric Logic"). One teacher-forced pass over every
   answer keeps every layer's states; per layer, the answers' centroids go to
   llmkit.serving.guard.evaluation.dispersion_by_layer: violating vs compliant entropy
   power per dimension (Ledoit-Wolf logdet and k-NN entropy in a cross-fitted PCA basis,
   total variance in the full space), on conflict-setting answers only (same prompts
   distribution, only the outcome differs), each task's mean removed first.
   `dispersion_ratio_violating_vs_compliant` is the IHEval logdet ratio, geometric mean
   over the guard layers (> 1: violations scatter more, as the paper says).
4. Split. Items go to fit / val / test (40/20/40 %) by a hash of (dataset, task, id), so
   an item's aligned and conflict forms stay together. Four guards are fitted on the fit
   part (70 % of its compliant answers for the manifold, 30 % for calibration; the
   supervised ones also learn from its violations, 30 % of them held out to combine):
   the Mahalanobis energy (`aeo`), the entropic divergence (`entropic`), the probe
   (`probe_guard`) and energy + probe (`combined_guard`). Cross-source
   (llmkit.experiments.guard.cross_source): each score is fitted on one source alone and
   tested on another it never saw (IHEval safety -> rule-following and tool-use, IHEval ->
   GSM8K secret word, and the reverse directions): `auroc_cross_<fit>_to_<test>_<score>`
   with intervals in `cross_source`, and `realized_fpr_<score>`, the mean over the pairs of
   the share of the test source's clean answers over the threshold fitted for 0.05. The
   default (`default_score`) is the score with the best worst-case cross-source AUROC
   (`default_worst_cross_auroc`, `default_realized_fpr_cross`); the out-of-fold AUROC of the
   unsupervised scores over fit + val (evaluation.cross_validated_auroc) is reported beside it.
   The default's threshold is set on the val part's compliant answers at --target-fpr, and
   `realized_fpr` is the fraction of the test part's compliant answers over it. Every
   in-source AUROC (sklearn roc_auc_score, stratified bootstrap interval) is on the test part.
   Baselines as before: perplexity, predictive entropy, keyword heuristic, a supervised probe
   on whole answers (trained on fit + val labels), the energy score on trajectory centroids.
5. Corrections, on the IHEval safety and rule-following test answers, with the default guard. Arms: no correction;
   re-prompt (flagged answers regenerated with the system instruction re-asserted, kept when
   their chaos score is lower: `iheval_guard_correct`); always regenerate (every answer
   regenerated with the reminder, no guard: `iheval_always_regenerate`); latent (the guard
   watches generation and, once the running score crosses the threshold, shifts the guard
   layers' states toward the compliant mean and generation continues:
   `iheval_latent_correct`; llmkit.serving.guard.rectify). The re-prompt arm reuses the
   always-regenerate arm's texts for its flagged answers (same prompt, same greedy decoding).
   With `--engine hf` the latent arm watches the transformers model generate (a latent-arm
   answer the guard never fired on is the plain greedy answer: the no-correction text is kept
   for it, and the run counts how many of those differ by batch numerics). With `--engine
   vllm` (the full run) the answers are vLLM's and the latent arm replays them
   (rectify_from_captures: the trigger is found on the served answer's captured states, an
   answer never flagged stays as served, a flagged one keeps its first t tokens and the
   transformers model continues with the shift); the same continuation with alpha 0
   (`iheval_latent_unsteered_continuation`) separates the steering from the engine switch.
   IHEval benchmark averaging per arm, with bootstrap intervals over answers and paired
   intervals of each arm's difference to no correction.
6. Overhead, on the serving path (unchanged from the first pass). The fitted guard is saved
   and two `llmkit serve` subprocesses (transformers engine, 1 torch thread each) start: one
   plain, one with `--guard DIR --guard-action annotate`; a few test prompts go one request at
   a time, alternately to each: `latency_ratio` and `cpu_ratio` (guard / plain). In-process:
   the guard's whole pass vs its prompt part and response part (`latency_ratio_prompt_hidden_est`).

Sizes. `--quick`: 10 IHEval items per variant file (prompts <= 400 tokens), 64 GSM8K
questions (128 answers), 24 new tokens, 4 latency requests, answers from the transformers
engine. Full: every IHEval safety and rule-following sample (4,532 answers, prompts up to
1,663 tokens, none skipped), 160 GSM8K questions (320 answers), 64 new tokens, 8 latency
requests, answers from vLLM (bf16, as `llmkit serve --engine vllm` serves them). The full
run is split so both cores work: N `--shard K/N` processes generate into one responses
cache, then capture their chunks into `--captures-dir`, then one process does the rest:

    .venv/bin/python bench/guard.py --quick
    for k in 0 1; do .venv/bin/python bench/guard.py --shard $k/2 --responses-cache R.json & done; wait
    for k in 0 1; do .venv/bin/python bench/guard.py --shard $k/2 --responses-cache R.json --captures-dir C & done; wait
    .venv/bin/python bench/guard.py --responses-cache R.json --captures-dir C

The committed guard_quick.json replays the full run's answers (guard_parts/responses_full.json.gz,
gunzipped to R.json; answers the file lacks, such as the tool-use ones, are generated and added;
the committed run's 90 tool-use answers came from the transformers engine, greedy, 64 tokens, since
vLLM on the loaded shared CPU did not finish them):

    .venv/bin/python bench/guard.py --quick --engine vllm --max-new-tokens 64 --responses-cache R.json

Labels. IHEval tasks graded by a continuous metric (get-webpage's ROUGE) or by many IFEval checks
rarely reach a strict score of 1, so with the bundled model a small slice of rule-following or
tool-use answers may hold no compliant answer: a cross-source pair without both kinds is reported
as undefined and left out of the worst case.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path
from statistics import mean

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ["safety/user-prompt-hijack", "safety/system-prompt-extract", "rule-following/single-turn",
         "tool-use/get-webpage", "tool-use/slack-user"]
ARM_TASKS = TASKS[:3]  # the correction arms and latency prompts (tool-use answers serve the cross-source part)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small slices (tens of minutes on the shared CPU)")
    p.add_argument("--data", default="../shared/data/iheval/benchmark", help="IHEval benchmark folder")
    p.add_argument("--gsm8k", default="../shared/data/gsm8k/test.jsonl", help="GSM8K jsonl for the injection set")
    p.add_argument("--limit", type=int, default=None,
                   help="IHEval items per variant file (quick 10; full: every sample)")
    p.add_argument("--gsm8k-questions", type=int, default=None, help="GSM8K questions (quick 64, full 160)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="quick 24, full 64")
    p.add_argument("--tasks", default=None, help="comma-separated IHEval tasks")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip samples with longer prompts (quick 400: the long Tensor Trust attacks dominate "
                   "CPU time; full 2048: every sample)")
    p.add_argument("--engine", choices=("hf", "vllm"), default=None,
                   help="engine that generates the answers of the no-correction and always-regenerate arms "
                   "(quick hf; full vllm, bf16 as `llmkit serve --engine vllm` serves; the guard, its captures and "
                   "the latent arm always run on the transformers model)")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="only generate the K-th of N slices of the answers into --responses-cache, then exit "
                   "(run N of these side by side, one per core, then the whole bench reads the cache)")
    p.add_argument("--components", type=int, default=16)
    p.add_argument("--target-fpr", type=float, default=0.1)
    p.add_argument("--alpha", type=float, default=0.5, help="latent rectification: fraction of the drift removed")
    p.add_argument("--min-tokens", type=int, default=8, help="latent rectification: tokens before the first check")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1: extra threads on the shared 2-core machine "
                   "oversubscribe and run ~20x slower)")
    p.add_argument("--latency-requests", type=int, default=None, help="quick 4, full 8")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples per interval")
    p.add_argument("--out", default=None, help="results JSON (default bench/results/guard_quick.json with --quick, "
                   "else bench/results/guard.json); the PNG goes beside it")
    p.add_argument("--responses-cache", default=None,
                   help="JSON file: reuse the texts stored there for the same configuration (per arm), else "
                   "generate and store them (saved every few dozen answers and merged under a file lock, so a "
                   "run cut by its time slot resumes and --shard runs can share one file)")
    p.add_argument("--captures-dir", default=None,
                   help="folder for the hidden-state captures of the answers (chunk files, GBs for a full run): read "
                   "back on a rerun with the same answers; with --shard, the shards capture their chunks there "
                   "once every shard has generated")
    args = p.parse_args(argv)
    if args.shard is not None:
        try:
            k, n = (int(x) for x in args.shard.split("/"))
            if not 0 <= k < n:
                raise ValueError
        except ValueError:
            p.error(f"--shard takes K/N with 0 <= K < N, got {args.shard!r}")
        if not args.responses_cache:
            p.error("--shard needs --responses-cache (the file the shards fill)")
        args.shard = (k, n)
    return args


class TextCache:
    """Generated values per arm and prompt, keyed by the configuration (resumable runs; new prompts only).

    Values are saved every ``chunk`` prompts, merged with what the file holds under an exclusive lock,
    so several processes (``--shard``) can fill one file and a run cut short keeps what it made.
    """

    def __init__(self, path, key: dict, chunk: int = 48):
        self.path, self.key, self.chunk = (Path(path) if path else None), key, chunk
        self.data: dict[str, dict[str, object]] = self._read()

    def _read(self) -> dict:
        if self.path and self.path.is_file() and self.path.stat().st_size:
            stored = json.loads(self.path.read_text())
            if stored.get("key") == self.key and stored.get("version") == 2:
                return stored.get("arms", {})
        return {}

    def _save(self):
        import fcntl
        import os

        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for arm, values in self._read().items():  # what other processes stored meanwhile
                for h, v in values.items():
                    self.data.setdefault(arm, {}).setdefault(h, v)
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": self.key, "version": 2, "arms": self.data}) + "\n")
            os.replace(tmp, self.path)

    @staticmethod
    def _hash(prompt: str) -> str:
        return hashlib.sha256(prompt.encode()).hexdigest()

    def count_missing(self, arm: str, prompts: list[str]) -> int:
        store = self.data.get(arm, {})
        return sum(1 for h in {self._hash(p) for p in prompts} if h not in store)

    def get(self, arm: str, prompts: list[str], make):
        """Values for ``prompts``; ``make(missing_prompts)`` produces those not stored yet."""
        store = self.data.setdefault(arm, {})
        hs = [self._hash(p) for p in prompts]
        missing = sorted({h: p for h, p in zip(hs, prompts) if h not in store}.items(), key=lambda hp: len(hp[1]))
        if len(missing) < len(prompts):
            print(f"# {arm}: {len(prompts) - len(missing)} of {len(prompts)} read from {self.path}", flush=True)
        step = self.chunk if self.path else max(1, len(missing))
        for start in range(0, len(missing), step):
            part = missing[start : start + step]
            for (h, _), v in zip(part, make([p for _, p in part])):
                store[h] = v
            if self.path:
                self._save()
                print(f"# {arm}: {min(start + step, len(missing))} of {len(missing)} new answers stored", flush=True)
        return [store[h] for h in hs]


def capture_chunked(model, tok, convs, all_layers, keep_layers, *, max_length, chunk=128, out_dir=None,
                    shard=None, progress=True):
    """Every layer's response centroid and the guard layers' whole captures, a chunk of answers at a time.

    Every layer's states of thousands of answers do not fit in memory, and the capture is the longest
    step: chunks (answers in length order) are saved to ``out_dir`` when given and read back on a rerun
    with the same answers; ``shard=(k, n)`` captures only chunks k, k+n, ... (one process per core).
    Returns ``(centroids: layer -> (n, d) array, captures)``; rows of chunks left to other shards are NaN / None.
    """
    import numpy as np
    import torch

    from llmkit.serving.guard import Capture, capture

    order = sorted(range(len(convs)), key=lambda i: (sum(len(m["content"]) for m in convs[i]), i))
    chunks = [order[s : s + chunk] for s in range(0, len(order), chunk)]
    d = model.config.hidden_size
    centroids = {l: np.full((len(convs), d), np.nan, dtype=np.float32) for l in all_layers}
    caps = [None] * len(convs)
    out = Path(out_dir) if out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    t0, done = time.time(), 0
    mine = [c for c in range(len(chunks)) if shard is None or c % shard[1] == shard[0]]
    for n_done, c in enumerate(mine):
        idx = chunks[c]
        key = hashlib.sha256(json.dumps([[convs[i] for i in idx], list(all_layers), list(keep_layers), max_length],
                                        sort_keys=True).encode()).hexdigest()
        path = out / f"chunk{c:04d}.pt" if out else None
        stored = torch.load(path, weights_only=False) if path and path.is_file() else None
        if stored is None or stored.get("key") != key:
            part = capture(model, tok, [convs[i] for i in idx], list(all_layers), with_logprobs=True, batch_size=8,
                           max_length=max_length)
            stored = {"key": key,
                      "centroids": {l: torch.stack([p.states[l].mean(0) for p in part]) for l in all_layers},
                      "caps": [Capture(states={l: p.states[l] for l in keep_layers}, token_logprobs=p.token_logprobs,
                                       token_entropies=p.token_entropies, n_tokens=p.n_tokens) for p in part]}
            if path:
                torch.save(stored, path)
            done += len(idx)
        if shard is not None:  # a shard only writes its chunks: the process that reads them all keeps them
            del stored
            continue
        for r, i in enumerate(idx):
            for l in all_layers:
                centroids[l][i] = stored["centroids"][l][r].numpy()
            caps[i] = stored["caps"][r]
        del stored
        if progress:
            print(f"# capture chunk {n_done + 1}/{len(mine)} ({done} answers captured, "
                  f"{time.time() - t0:.0f} s)", flush=True)
    return centroids, caps


def generate_sorted(engine, prompts, params, progress=True):
    """Generate in length order (left-padded batches of similar length waste less), return in input order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs = engine.generate([prompts[i] for i in order], params, progress=progress)
    texts = [""] * len(prompts)
    for j, i in enumerate(order):
        texts[i] = outs[j][0].text
    return texts


def iheval_scores(rows) -> dict:
    from llmkit.evals import iheval

    agg = iheval.aggregate(rows)
    settings = [s for s in ("aligned", "conflict") if s in agg]
    agg["overall"] = mean(agg[s] for s in settings)
    return agg


def _geo_mean(xs):
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(mean(math.log(x) for x in xs)) if xs else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmkit.engines.hf import HFEngine
    from llmkit.evals import iheval
    from llmkit.experiments import guard as X
    from llmkit.generation import GenerationParams
    from llmkit.models import DEFAULT_MODEL, load
    from llmkit.serving.guard import Manifold, capture, default_layers
    from llmkit.serving.guard import baselines as B
    from llmkit.serving.guard import evaluation as E
    from llmkit.serving.guard import injection as I
    from llmkit.serving.guard import score as S
    from llmkit.serving.guard.correct import reasserted
    from llmkit.serving.guard.rectify import generate_rectified, rectify_from_captures

    torch.manual_seed(0)
    threads = args.threads or 1
    torch.set_num_threads(threads)
    limit = args.limit or (10 if args.quick else None)
    n_gsm = args.gsm8k_questions or (64 if args.quick else 160)
    max_new = args.max_new_tokens or (24 if args.quick else 64)
    tasks = args.tasks.split(",") if args.tasks else TASKS
    n_lat = args.latency_requests or (4 if args.quick else 8)
    max_prompt = args.max_prompt_tokens or (400 if args.quick else 2048)
    cap_len = max(1024, max_prompt + max_new)  # the capture keeps whole prompts
    engine_kind = args.engine or ("hf" if args.quick else "vllm")
    t_start = time.time()

    def stamp(what):
        print(f"# {what} at {time.time() - t_start:.0f} s", flush=True)

    model, tok = load(DEFAULT_MODEL)
    engine = HFEngine(model, tok, batch_size=8)  # prompts, the guard's checks and the serving-path timings
    params = GenerationParams(max_new_tokens=max_new, temperature=0.0)
    gen_engine = [engine] if engine_kind == "hf" else []

    def generate_answers(ps):
        if not gen_engine:  # started only when some answer is not in the cache yet
            from llmkit.engines.vllm import VLLMEngine

            gen_engine.append(VLLMEngine(DEFAULT_MODEL, dtype="bfloat16", max_model_len=max(2048, max_prompt + max_new),
                                         enforce_eager=True))
        return generate_sorted(gen_engine[0], ps, params, progress=engine_kind == "hf")

    # ---- items: IHEval and the GSM8K secret-word set, one list --------------------------------
    items = []
    for s in iheval.load(args.data, tasks=tasks, settings=["aligned", "conflict"], limit=limit):
        if s["id"] in iheval.INSTRUCTION_IDS:
            continue
        items.append({"dataset": "iheval", "task": f"{s['category']}/{s['task']}", "setting": s["setting"],
                      "key": f"iheval/{s['task']}/{s['id']}", "sample": s, "messages": iheval.build_messages(s),
                      "prompt": iheval.render_prompt(tok, s)})
    for s in I.build(I.gsm8k_questions(args.gsm8k, limit=n_gsm)):
        items.append({"dataset": "gsm8k_inject", "task": "gsm8k/secret-word", "setting": s["setting"],
                      "key": s["id"], "sample": s, "messages": s["messages"],
                      "prompt": engine.chat_prompt(s["messages"])})
    items = [it for it in items if len(tok(it["prompt"], add_special_tokens=False)["input_ids"]) <= max_prompt]
    for it in items:
        it["part"] = E.split(f"{it['dataset']}/{it['key']}")
    n_ih = sum(it["dataset"] == "iheval" for it in items)
    print(f"# {n_ih} IHEval samples ({', '.join(tasks)}) + {len(items) - n_ih} GSM8K secret-word samples; "
          f"greedy, {max_new} new tokens", flush=True)

    # ---- 1. responses and grades --------------------------------------------------------------
    cache = TextCache(args.responses_cache, {"model": DEFAULT_MODEL, "max_new_tokens": max_new,
                                             "alpha": args.alpha, "min_tokens": args.min_tokens,
                                             "components": args.components, "target_fpr": args.target_fpr,
                                             **({"engine": engine_kind} if engine_kind != "hf" else {})},
                      chunk=48 if engine_kind == "hf" else 256)
    prompts = [it["prompt"] for it in items]
    # the always-regenerate arm's prompts (IHEval test items, instruction re-asserted) do not depend on any answer
    ih_test_all = [i for i, it in enumerate(items) if it["part"] == "test" and it["dataset"] == "iheval"
                   and it["task"] in ARM_TASKS]
    regen_prompts = [engine.chat_prompt(reasserted(items[i]["messages"], tok)) for i in ih_test_all]
    if args.shard:
        k, n = args.shard
        def slice_of(ps):  # the same slices in every process (a set's order is not)
            return sorted(set(ps), key=lambda p: (len(p), p))[k::n]

        cache.get("base", slice_of(prompts), generate_answers)
        cache.get("always_regenerate", slice_of(regen_prompts), generate_answers)
        stamp(f"shard {k}/{n} generated into {args.responses_cache}")
        if not args.captures_dir:
            return 0
        while True:  # the capture needs every answer: wait for the other shards
            cache = TextCache(args.responses_cache, cache.key)
            left = cache.count_missing("base", prompts)
            if not left:
                break
            print(f"# waiting for the other shards: {left} answers not generated yet", flush=True)
            time.sleep(30)
        texts = cache.get("base", prompts, generate_answers)
    else:
        texts = cache.get("base", prompts, generate_answers)
    stamp("responses ready")

    def grade(it, text) -> dict:
        if it["dataset"] == "iheval":
            return iheval.score_response(it["sample"], text)
        ok = float(not I.violates(it["sample"], text))
        return {"strict": ok, "loose": ok}

    grades = [grade(it, t) for it, t in zip(items, texts)]
    passed = [g["strict"] >= 1.0 for g in grades]
    labels = [None if (it["dataset"] == "iheval" and it["setting"] == "aligned" and not ok)
              else int(it["setting"] == "conflict" and not ok) for it, ok in zip(items, passed)]

    # ---- 2. one capture of every layer --------------------------------------------------------
    n_layers = model.config.num_hidden_layers
    layers = default_layers(n_layers)
    convs = [[*it["messages"], {"role": "assistant", "content": t}] for it, t in zip(items, texts)]
    centroids, caps = capture_chunked(model, tok, convs, range(1, n_layers + 1), layers, max_length=cap_len,
                                      out_dir=args.captures_dir, shard=args.shard)
    if args.shard:
        stamp(f"shard {args.shard[0]}/{args.shard[1]} captured into {args.captures_dir}")
        return 0
    stamp("states captured")

    # ---- 3. the asymmetry, per layer -----------------------------------------------------------
    dispersion: dict = {}
    for ds in ("iheval", "gsm8k_inject"):
        idx = [i for i, it in enumerate(items) if it["dataset"] == ds and it["setting"] == "conflict"]
        lab = [labels[i] for i in idx]
        if sum(1 for y in lab if y == 1) < 6 or sum(1 for y in lab if y == 0) < 6:
            print(f"# dispersion {ds}: fewer than 6 answers in a group, skipped", flush=True)
            continue
        dispersion[ds] = E.dispersion_by_layer({l: c[idx] for l, c in centroids.items()}, lab,
                                               groups=[items[i]["task"] for i in idx], n_components=8,
                                               n_draws=10, n_resamples=args.bootstrap // 4)
    res: dict = {}
    for ds, per in dispersion.items():
        for est in ("logdet", "knn", "trace"):
            res[f"dispersion_{est}_{ds}"] = _geo_mean([per[l][est]["ratio"] for l in layers])
    res["dispersion_ratio_violating_vs_compliant"] = res.get("dispersion_logdet_iheval", float("nan"))
    stamp("dispersion measured")

    # ---- 4. guards, default by worst-case cross-source AUROC, threshold, test AUROC ------------
    part = [it["part"] for it in items]
    fit_ok = [i for i in range(len(items)) if part[i] == "fit" and labels[i] == 0]
    random.Random(0).shuffle(fit_ok)  # calibration must mix tasks and settings like the manifold data
    n_cal = max(2, int(0.3 * len(fit_ok)))
    shape = {"model_name": DEFAULT_MODEL, "hidden_size": model.config.hidden_size, "num_layers": n_layers,
             "n_components": args.components}
    # the same compliant split as fit_ok / n_cal (same seed); probe and combined also use the fit part's violations
    guards, guard_errors = X.fit_guards(caps, labels, [i for i in range(len(items)) if part[i] == "fit"],
                                        target_fpr=args.target_fpr, **shape)
    for kind, err in guard_errors.items():
        print(f"# {kind} guard not fitted on the fit part: {err}", flush=True)
    scores = {kind: g.score_captures(caps).tolist() for kind, g in guards.items()}
    cross = X.cross_source(caps, labels, [X.sources_of(it["dataset"], it["task"]) for it in items],
                           target_fpr=0.05, n_resamples=args.bootstrap, progress=lambda m: print(f"# {m}", flush=True),
                           **shape)
    res.update(cross["figures"])
    stamp("cross-source evaluation done")
    val = [i for i in range(len(items)) if part[i] == "val" and labels[i] is not None]
    test = [i for i in range(len(items)) if part[i] == "test" and labels[i] is not None]
    val_auroc = {k: E.auroc([scores[k][i] for i in val], [labels[i] for i in val]) for k in guards}
    # the out-of-fold AUROC of the unsupervised scores over the fit and val parts (5 folds by item) is reported; the
    # default is the score with the best worst-case cross-source AUROC (never chosen on the test part)
    dev = [i for i in range(len(items)) if part[i] in ("fit", "val")]
    cv_auroc = E.cross_validated_auroc([caps[i] for i in dev], [labels[i] for i in dev],
                                       [f"{items[i]['dataset']}/{items[i]['key']}" for i in dev],
                                       model_name=DEFAULT_MODEL, hidden_size=model.config.hidden_size,
                                       num_layers=n_layers, n_components=args.components)
    default = cross["default_score"] if cross["default_score"] in guards else "energy"
    guard = guards[default]
    val_ok = [scores[default][i] for i in val if labels[i] == 0]
    guard.threshold = S.threshold_at_fpr(torch.tensor(val_ok), args.target_fpr)
    guard.meta.update(threshold=guard.threshold, threshold_set_on="validation compliant answers",
                      n_threshold=len(val_ok))
    res["default_score"] = default
    res["default_worst_cross_auroc"] = res[f"worst_cross_auroc_{default}"]
    res["default_realized_fpr_cross"] = res[f"realized_fpr_{default}"]
    res.update({f"val_auroc_{k}": v for k, v in val_auroc.items()})
    res["cv_auroc_energy"], res["cv_auroc_entropic"] = cv_auroc["energy"], cv_auroc["entropic"]
    res["realized_fpr"] = E.realized_fpr([scores[default][i] for i in test if labels[i] == 0], guard.threshold)
    res["target_fpr"] = args.target_fpr

    fit_lab = [i for i in range(len(items)) if part[i] in ("fit", "val") and labels[i] is not None]
    try:
        probe = B.Probe(layers).fit([caps[i] for i in fit_lab], [labels[i] for i in fit_lab])
        probe_all = probe.scores(caps)
    except ValueError:  # one class only: the probe cannot train
        probe_all = [0.0] * len(caps)
    cent = B.pooled(caps, layers)
    d = model.config.hidden_size
    fit_rows = fit_ok[n_cal:]
    cent_m = {j: Manifold.fit(cent[fit_rows, j * d : (j + 1) * d], args.components) for j in range(len(layers))}
    cent_raw = torch.stack([cent_m[j].energy(cent[:, j * d : (j + 1) * d]) for j in range(len(layers))], 1)
    med, scale = S.robust_scale(cent_raw[fit_ok[:n_cal]].double())
    methods = {"aeo": scores["energy"], "entropic": scores["entropic"],
               **{f"{k}_guard": scores[k] for k in ("probe", "combined") if k in scores},
               "aeo_centroid": S.chaos(cent_raw.double(), med, scale).tolist(),
               "perplexity": B.perplexity_scores(caps), "entropy": B.entropy_scores(caps),
               "keyword": [B.keyword_score(it["messages"], t) for it, t in zip(items, texts)], "probe": probe_all}
    auroc_ci = {}
    for ds_name, ds_filter in (("", None), ("_iheval", "iheval"), ("_gsm8k_inject", "gsm8k_inject")):
        rows = [i for i in test if ds_filter is None or items[i]["dataset"] == ds_filter]
        y = [labels[i] for i in rows]
        for name, sc in methods.items():
            ci = E.auroc_ci([sc[i] for i in rows], y, n_resamples=args.bootstrap)
            auroc_ci[f"{name}{ds_name}"] = ci
            if not ds_name:
                res[f"auroc_{name}"] = ci["auroc"]
                res[f"fpr95_{name}"] = B.fpr_at_tpr([sc[i] for i in rows], y)
    ds_scores = scores[default]
    y_test = [labels[i] for i in test]
    res["aeo_tpr_at_threshold"] = (sum(1 for i in test if labels[i] == 1 and ds_scores[i] > guard.threshold)
                                   / max(1, sum(y_test)))
    res["aeo_fpr_at_threshold"] = res["realized_fpr"]
    res["auroc_aeo_setting"] = E.auroc([ds_scores[i] for i in ih_test_all],
                                       [int(items[i]["setting"] == "conflict") for i in ih_test_all])
    stamp("detection done")

    # ---- 5. corrections on the IHEval test answers --------------------------------------------
    arm_idx = ih_test_all
    arm_msgs = [items[i]["messages"] for i in arm_idx]
    regen = cache.get("always_regenerate", regen_prompts, generate_answers)
    flagged = [ds_scores[i] > guard.threshold for i in arm_idx]
    # the re-prompt arm keeps a regenerated answer only when its own chaos score is lower: only flagged rows need it
    fl = [j for j, f in enumerate(flagged) if f]
    fl_caps = capture(model, tok, [[*arm_msgs[j], {"role": "assistant", "content": regen[j]}] for j in fl], layers,
                      batch_size=8, max_length=cap_len)
    regen_scores = dict(zip(fl, guard.score_captures(fl_caps).tolist())) if fl else {}
    reprompt = [regen[j] if (flagged[j] and regen_scores[j] < ds_scores[i]) else texts[i]
                for j, i in enumerate(arm_idx)]

    by_prompt = {items[i]["prompt"]: i for i in arm_idx}

    if engine_kind == "hf":  # the answers are this model's own greedy generations: watch them being generated
        def make_latent(ps):
            outs = generate_rectified(model, tok, guard, [items[by_prompt[p]]["messages"] for p in ps], params,
                                      alpha=args.alpha, min_tokens=args.min_tokens, batch_size=8, progress=True)
            return [{"text": o.text, "triggered_at": o.triggered_at} for o in outs]
        latent_arms = {"latent": make_latent}
    else:  # served by vLLM: find the trigger on the served answer's states and continue it with the transformers
        # model; the same continuation without the shift (alpha 0) separates the steering from the engine switch
        def replay(alpha):
            def make(ps):
                idx = [by_prompt[p] for p in ps]
                outs = rectify_from_captures(model, tok, guard, [items[i]["messages"] for i in idx],
                                             [texts[i] for i in idx], [caps[i] for i in idx], params, alpha=alpha,
                                             min_tokens=args.min_tokens, batch_size=8, progress=True)
                return [{"text": o.text, "triggered_at": o.triggered_at} for o in outs]
            return make
        latent_arms = {"latent": replay(args.alpha), "latent_unsteered": replay(0.0)}
    latent_raw = {name: cache.get(f"{name}/{default}/{guard.threshold:.6g}/{engine_kind}",
                                  [items[i]["prompt"] for i in arm_idx], make)
                  for name, make in latent_arms.items()}
    latent_text = {name: [o["text"] if o["triggered_at"] is not None else texts[i] for i, o in zip(arm_idx, raw)]
                   for name, raw in latent_raw.items()}
    untriggered_differ = sum(1 for i, o in zip(arm_idx, latent_raw["latent"])
                             if o["triggered_at"] is None and o["text"] != texts[i])
    arms = {"no_guard": [texts[i] for i in arm_idx], "guard_correct": reprompt, "always_regenerate": regen,
            "latent_correct": latent_text["latent"]}
    if "latent_unsteered" in latent_text:
        arms["latent_unsteered_continuation"] = latent_text["latent_unsteered"]
    arm_rows = {}
    for arm, ts in arms.items():
        rows = []
        for i, t in zip(arm_idx, ts):
            s = items[i]["sample"]
            g = iheval.score_response(s, t) if t != texts[i] else grades[i]
            rows.append({**g, "_category": s["category"], "_task": s["task"], "_setting": s["setting"],
                         "_variant": s["variant"], "_id": s["id"]})
        arm_rows[arm] = rows

    def overall(arm):
        return lambda idx: iheval_scores([arm_rows[arm][j] for j in idx])["overall"]

    arm_ci, per_task = {}, {}
    for arm in arms:
        arm_ci[arm] = E.aggregate_ci(len(arm_idx), overall(arm), n_resamples=args.bootstrap)
        if arm != "no_guard":
            arm_ci[f"{arm}_minus_no_guard"] = E.aggregate_ci(len(arm_idx), overall(arm),
                                                             baseline=overall("no_guard"),
                                                             n_resamples=args.bootstrap)
        res[f"iheval_{arm}"] = arm_ci[arm]["value"]
        for k, v in iheval_scores(arm_rows[arm]).items():
            per_task.setdefault(k, {})[arm] = v
    stamp("corrections done")

    # ---- 6. overhead on the serving path --------------------------------------------------------
    lat_idx = sorted(arm_idx, key=lambda i: len(prompts[i]))[:: max(1, len(arm_idx) // n_lat)][:n_lat]
    lat_msgs = [items[i]["messages"] for i in lat_idx]
    lat = serving_overhead(guard, lat_msgs, max_new, threads)
    res["latency_ratio"] = lat.pop("latency_ratio")
    res["cpu_ratio"] = lat.pop("cpu_ratio")
    t_whole = t_pre = t_resp = 0.0
    max_dev = 0.0
    for m, text in zip(lat_msgs, lat["guard_texts"]):
        t0 = time.perf_counter()
        whole = guard.check(engine, m, text)
        t1 = time.perf_counter()
        pre = guard.prefill(engine, m)
        t2 = time.perf_counter()
        fast = guard.check(engine, m, text, prefill=pre)
        t3 = time.perf_counter()
        t_whole, t_pre, t_resp = t_whole + t1 - t0, t_pre + t2 - t1, t_resp + t3 - t2
        max_dev = max(max_dev, abs(whole["score"] - fast["score"]))
    lat.update(check_whole_s=t_whole, check_prefill_part_s=t_pre, check_response_part_s=t_resp,
               max_score_diff_prefill_vs_whole=max_dev)
    lat["served_scores_equal_whole_pass"] = all(abs(a - b) <= 1e-3 for a, b in zip(
        lat["guard_scores"], [guard.check(engine, m, t)["score"] for m, t in zip(lat_msgs, lat["guard_texts"])]))
    res["latency_ratio_prompt_hidden_est"] = (lat["plain_s"] + t_resp) / lat["plain_s"]
    del lat["guard_texts"], lat["guard_scores"]
    stamp("overhead measured")

    # ---- report ---------------------------------------------------------------------------------
    def n_lab(rows, y):
        return sum(1 for i in rows if labels[i] == y)

    counts = {
        "answers_scored": len(items), "iheval": n_ih, "gsm8k_inject": len(items) - n_ih,
        "violations": n_lab(range(len(items)), 1), "compliant": n_lab(range(len(items)), 0),
        "aligned_failures_excluded": sum(1 for y in labels if y is None),
        "fit_compliant_manifold": len(fit_ok) - n_cal, "fit_compliant_calibration": n_cal,
        "val_violations": n_lab(val, 1), "val_compliant": n_lab(val, 0),
        "test_violations": n_lab(test, 1), "test_compliant": n_lab(test, 0),
        "iheval_test_answers": len(arm_idx), "test_flagged": sum(flagged),
        "latent_triggered": sum(1 for o in latent_raw["latent"] if o["triggered_at"] is not None),
        "latent_untriggered_text_differs": untriggered_differ,
        "regenerated_answers": len(regen), "latency_requests": len(lat_idx),
    }
    for ds in ("iheval", "gsm8k_inject"):
        conf = [i for i, it in enumerate(items) if it["dataset"] == ds and it["setting"] == "conflict"]
        counts[f"{ds}_conflict_violations"] = n_lab(conf, 1)
        counts[f"{ds}_conflict_compliant"] = n_lab(conf, 0)
    per_setting_pass = {}
    for task in sorted({it["task"] for it in items}):
        for setting in ("aligned", "conflict"):
            v = [passed[i] for i, it in enumerate(items) if it["task"] == task and it["setting"] == setting]
            if v:
                per_setting_pass[f"{task}:{setting}"] = sum(v) / len(v)

    for ds, per in dispersion.items():
        for est in ("logdet", "knn", "trace"):
            r = res[f"dispersion_{est}_{ds}"]
            line = " ".join(f"L{l}:{per[l][est]['ratio']:.2f}" for l in layers)
            print(f"dispersion {ds:12s} {est:6s} violating/compliant (geo-mean over guard layers): {r:.3f}  [{line}]")
        tr = [per[l]["trace"] for l in layers]
        print(f"dispersion {ds:12s} trace 95% CI per guard layer: "
              + " ".join(f"L{l}:[{t['ci_low']:.2f},{t['ci_high']:.2f}]" for l, t in zip(layers, tr)))
    for name in methods:
        ci = auroc_ci[name]
        extra = "  ".join(f"{ds}: {auroc_ci[name + '_' + ds]['auroc']:.3f}" for ds in ("iheval", "gsm8k_inject"))
        print(f"detection {name:12s}: AUROC {ci['auroc']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]  "
              f"FPR@95%TPR {res[f'fpr95_{name}']:.3f}  ({extra})")
    n_dev = sum(1 for i in dev if labels[i] is not None)
    print(f"out-of-fold AUROC on fit+val ({n_dev} answers, {sum(1 for i in dev if labels[i] == 1)} violations): "
          f"energy {cv_auroc['energy']:.3f}, entropic {cv_auroc['entropic']:.3f}; val part alone: "
          + ", ".join(f"{k} {v:.3f}" for k, v in val_auroc.items()))
    for line in X.summary_lines(cross):
        print(line)
    print(f"threshold at target FPR {args.target_fpr:.2f} on {len(val_ok)} val compliant answers: realized FPR "
          f"{res['realized_fpr']:.3f} on {n_lab(test, 0)} fresh test compliant answers; TPR "
          f"{res['aeo_tpr_at_threshold']:.3f} on {n_lab(test, 1)} test violations")
    print(f"AEO ({default}, setting labels): AUROC {res['auroc_aeo_setting']:.3f}")
    for arm in arms:
        ci = arm_ci[arm]
        diff = arm_ci.get(f"{arm}_minus_no_guard")
        dtxt = f"  vs no correction {diff['value']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]" if diff else ""
        print(f"IHEval {arm:18s}: {ci['value']:.3f} [{ci['low']:.3f}, {ci['high']:.3f}]{dtxt}")
    for k, v in per_task.items():
        print(f"IHEval {k:45s}: " + "  ".join(f"{a} {v.get(a, float('nan')):.3f}" for a in arms))
    print(f"serving latency, llmkit serve --guard (annotate) / no guard, hf, 1 request at a time: "
          f"{res['latency_ratio']:.3f}  ({lat['guard_s']:.1f} s vs {lat['plain_s']:.1f} s over {len(lat_idx)} requests)")
    print(f"serving CPU seconds, guard / no guard: {res['cpu_ratio']:.3f}  ({lat['cpu_guard_s']:.1f} s vs "
          f"{lat['cpu_plain_s']:.1f} s)")
    print(f"estimated latency ratio if the prompt part were hidden beside generation (plain server + in-process "
          f"response part): {res['latency_ratio_prompt_hidden_est']:.3f}")
    print(f"counts: {json.dumps(counts)}")

    out_path = Path(args.out) if args.out else RESULTS / ("guard_quick.json" if args.quick else "guard.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out = {"figures": res, "cross_source": cross["pairs"], "cross_source_comparable_pairs": cross["comparable_pairs"],
           "auroc_intervals": auroc_ci, "iheval_arm_intervals": arm_ci, "iheval_per_task": per_task,
           "dispersion_per_layer": {ds: {str(l): v for l, v in per.items()} for ds, per in dispersion.items()},
           "latency": lat, "pass_rate_by_setting": per_setting_pass, "counts": counts,
           "threshold": guard.threshold, "layers": layers,
           "config": {"model": DEFAULT_MODEL, "engine": engine_kind, "tasks": tasks, "limit": limit,
                      "gsm8k_questions": n_gsm,
                      "max_new_tokens": max_new, "max_prompt_tokens": max_prompt, "components": args.components,
                      "target_fpr": args.target_fpr, "alpha": args.alpha, "min_tokens": args.min_tokens,
                      "bootstrap": args.bootstrap, "quick": args.quick},
           "seconds": round(time.time() - t_start, 1)}
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    _plot(out_path.with_suffix(".png"), dispersion, layers, {k: [v[i] for i in test] for k, v in methods.items()},
          y_test, arm_ci, default)
    print(f"results written to {out_path}")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


class _Server:
    """`llmkit serve` as a subprocess on loopback (log in a temp file, named if it fails)."""

    def __init__(self, extra: list[str], threads: int):
        import socket
        import subprocess
        import tempfile

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open as the server's log
            "w+", prefix="llmkit-guard-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "llmkit.cli", "serve", "--port", str(port), "--threads", str(threads),
               "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1])
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; log: {self.log.name}")
            time.sleep(1)

    def cpu_s(self) -> float:
        import os

        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads

    def ask(self, messages, max_tokens: int) -> tuple[float, float, dict]:
        import httpx

        c0, t0 = self.cpu_s(), time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", timeout=None,
                       json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t0, self.cpu_s() - c0, r.json()

    def stop(self):
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serving_overhead(guard, messages_list, max_tokens: int, threads: int) -> dict:
    """Client latency and server CPU of `llmkit serve` with and without the guard, same prompts, alternating."""
    import tempfile

    from llmkit.models import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as d:
        guard.save(d)
        plain = guarded = None
        try:
            plain = _Server(["--model", DEFAULT_MODEL], threads)
            guarded = _Server(["--model", DEFAULT_MODEL, "--guard", d, "--guard-action", "annotate"], threads)
            for srv in (plain, guarded):  # warm-up: lazy initialisation is not overhead
                srv.ask(messages_list[0], 8)
            out = {"plain_s": 0.0, "guard_s": 0.0, "cpu_plain_s": 0.0, "cpu_guard_s": 0.0, "tokens_plain": 0,
                   "tokens_guard": 0, "per_request": [], "guard_texts": [], "guard_scores": []}
            for j, m in enumerate(messages_list):
                order = [("plain", plain), ("guard", guarded)]
                if j % 2:  # alternate so that neither side always runs second
                    order.reverse()
                row = {}
                for name, srv in order:
                    dt, cpu, body = srv.ask(m, max_tokens)
                    out[f"{name}_s"] += dt
                    out[f"cpu_{name}_s"] += cpu
                    out[f"tokens_{name}"] += body["usage"]["completion_tokens"]
                    row[name] = round(dt, 3)
                    if name == "guard":
                        out["guard_texts"].append(body["choices"][0]["message"]["content"])
                        out["guard_scores"].append(body["choices"][0]["guard"]["score"])
                out["per_request"].append(row)
        finally:
            for srv in (plain, guarded):
                if srv is not None:
                    srv.stop()
    out["latency_ratio"] = out["guard_s"] / out["plain_s"]
    out["cpu_ratio"] = out["cpu_guard_s"] / max(out["cpu_plain_s"], 1e-9)
    return out


def _plot(path, dispersion: dict, guard_layers, scores: dict, y, arm_ci: dict, default: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for ds, per in dispersion.items():
        ls = sorted(per)
        for est, style in (("logdet", "-"), ("knn", ":"), ("trace", "--")):
            ax.plot(ls, [per[l][est]["ratio"] for l in ls], style, label=f"{ds} {est}")
    ax.axhline(1.0, color="k", lw=0.8)
    for l in guard_layers:
        ax.axvline(l, color="grey", lw=0.5, alpha=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("violating / compliant entropy power per dim")
    ax.set_title("Asymmetry (conflict answers, task-centred)")
    if dispersion:
        ax.legend(fontsize=7)
    ax = axes[1]
    if y and any(y) and not all(y):
        for name, s in scores.items():
            pairs = sorted(zip(s, y), key=lambda p: -p[0])
            P, N = sum(y), len(y) - sum(y)
            tp = fp = 0
            xs, ys = [0.0], [0.0]
            for _, lab in pairs:
                tp, fp = tp + lab, fp + (1 - lab)
                xs.append(fp / N)
                ys.append(tp / P)
            ax.plot(xs, ys, label=name, lw=2 if name in ("aeo", "entropic") else 1)
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title("Violation detection (test part)")
    if y and any(y) and not all(y):
        ax.legend(fontsize=7)
    ax = axes[2]
    arms = [a for a in arm_ci if not a.endswith("_minus_no_guard")]
    vals = [arm_ci[a]["value"] for a in arms]
    err = [[v - arm_ci[a]["low"] for a, v in zip(arms, vals)], [arm_ci[a]["high"] - v for a, v in zip(arms, vals)]]
    ax.bar(range(len(arms)), vals, yerr=err, capsize=4, color="tab:blue")
    ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=8)
    ax.set_ylabel("IHEval score (benchmark averaging), 95% CI")
    ax.set_title(f"Corrections, IHEval test answers (guard: {default})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
