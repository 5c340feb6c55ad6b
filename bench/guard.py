"""AEO guard benchmark with the bundled model: the asymmetry, the detectors, the corrections, the overhead.

On the same greedy answers to IHEval and the GSM8K secret-word set: dispersion per layer, detection AUROC
(in-source and cross-source) against baselines, correction arms on IHEval, `llmkit serve --guard` latency and
CPU. Stages: llmkit.experiments.guard; sizes: --quick below; results: bench/results/guard.md. The full run is split
over both cores (N `--shard K/N` processes generate, then capture, into shared files; one does the rest).
The committed guard_quick.json replays the full run's answers (guard_parts/responses_full.json.gz as R.json, the
last command below). Stored there too, made by the transformers engine (greedy, 64 tokens; vLLM on the loaded
shared CPU did not finish them): the 120 tool-use answers the full run lacks (the quick run's 90, and 30
get-webpage lang-detect ones generated to look for a compliant tool-use answer: none earned half the credit)
and the quick run's latent-arm answers:

    .venv/bin/python bench/guard.py --quick
    for k in 0 1; do .venv/bin/python bench/guard.py --shard $k/2 --responses-cache R.json & done; wait
    for k in 0 1; do .venv/bin/python bench/guard.py --shard $k/2 --responses-cache R.json --captures-dir C & done; wait
    .venv/bin/python bench/guard.py --responses-cache R.json --captures-dir C
    .venv/bin/python bench/guard.py --quick --engine vllm --max-new-tokens 64 --responses-cache R.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _limit(text: str):
    from llmkit.experiments.guard import parse_limit

    try:
        return parse_limit(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--quick", action="store_true", help="IHEval items per variant file: 20 safety, 40 rule-following, 10 "
        "tool-use (so that the cross-source pairs have both classes), prompts <= 400 tokens, 64 GSM8K questions, 24 "
        "new tokens, 4 latency requests, hf answers (full: every sample, 160, 64, 8, vLLM bf16)")
    add("--data", default="../shared/data/iheval/benchmark", help="IHEval benchmark folder")
    add("--gsm8k", default="../shared/data/gsm8k/test.jsonl", help="GSM8K jsonl for the injection set")
    add("--limit", type=_limit, default=None, help="IHEval items per variant file: N, or category=N,... over the "
        "quick sizes (quick safety=20,rule-following=40,tool-use=10; full: every sample)")
    add("--gsm8k-questions", type=int, default=None, help="GSM8K questions (quick 64, full 160)")
    add("--max-new-tokens", type=int, default=None, help="quick 24, full 64")
    add("--tasks", default=None, help="comma-separated IHEval tasks")
    add("--max-prompt-tokens", type=int, default=None, help="skip longer prompts (quick 400, full 2048: every sample)")
    add("--engine", choices=("hf", "vllm"), default=None, help="engine of the no-correction and always-regenerate "
        "answers (quick hf, full vllm bf16); the guard, its captures and the latent arm use the transformers model")
    add("--shard", default=None, metavar="K/N", help="generate (and with --captures-dir capture) only the K-th of N "
        "slices of the answers into --responses-cache, then exit; run N side by side, one per core")
    add("--components", type=int, default=16)
    add("--target-fpr", type=float, default=0.1)
    add("--alpha", type=float, default=0.5, help="latent rectification: fraction of the drift removed")
    add("--min-tokens", type=int, default=8, help="latent rectification: tokens before the first check")
    add("--threads", type=int, default=None, help="torch CPU threads (default 1: more oversubscribe a shared CPU)")
    add("--latency-requests", type=int, default=None, help="quick 4, full 8")
    add("--bootstrap", type=int, default=1000, help="bootstrap resamples per interval")
    add("--out", default=None, help="results JSON (default bench/results/guard[_quick].json), the PNG beside it")
    add("--responses-cache", default=None, help="JSON file of answers per arm for this configuration, saved as they "
        "come under a file lock: a cut run resumes and --shard runs share one file")
    add("--captures-dir", default=None, help="folder for the answers' hidden-state captures (GBs for a full run), "
        "read back on a rerun; --shard runs capture their chunks there once every shard has generated")
    args = p.parse_args(argv)
    if args.shard is not None:
        k, _, n = args.shard.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            p.error(f"--shard takes K/N with 0 <= K < N, got {args.shard!r}")
        if not args.responses_cache:
            p.error("--shard needs --responses-cache (the file the shards fill)")
        args.shard = (int(k), int(n))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmkit.engines.hf import HFEngine
    from llmkit.experiments import guard as X
    from llmkit.experiments.harness import KeyedCache
    from llmkit.generation import GenerationParams
    from llmkit.models import DEFAULT_MODEL, load
    from llmkit.serving.guard import default_layers

    torch.manual_seed(0)
    cfg = X.sizes(args.quick, **{k: getattr(args, k) for k in X.SIZE_FLAGS})
    torch.set_num_threads(cfg["threads"])
    kind, t_start = cfg["engine"], time.time()

    def stamp(what):
        print(f"# {what} at {time.time() - t_start:.0f} s", flush=True)

    model, tok = load(DEFAULT_MODEL)
    engine = HFEngine(model, tok, batch_size=8)  # prompts, the guard's checks and the serving-path timings
    params = GenerationParams(max_new_tokens=cfg["max_new_tokens"], temperature=0.0)
    generate = X.answer_generator(engine, kind, params, model=DEFAULT_MODEL,
                                  max_model_len=max(2048, cfg["max_prompt_tokens"] + cfg["max_new_tokens"]))
    items = X.load_items(args.data, args.gsm8k, tok, engine.chat_prompt, tasks=cfg["tasks"], limit=cfg["limit"],
                         gsm8k_questions=cfg["gsm8k_questions"], max_prompt_tokens=cfg["max_prompt_tokens"])
    print(X.describe_items(items, cfg), flush=True)
    cache = KeyedCache(args.responses_cache, X.responses_key(DEFAULT_MODEL, cfg, vars(args)),
                       chunk=48 if kind == "hf" else 256)
    prompts, arm_idx = [it["prompt"] for it in items], X.arm_rows(items)
    regen_prompts = X.regenerate_prompts(items, arm_idx, tok, engine.chat_prompt)
    if args.shard:
        X.generate_shard(cache, args.shard, prompts, regen_prompts, generate)
        stamp(f"shard {args.shard[0]}/{args.shard[1]} generated into {args.responses_cache}")
        if not args.captures_dir:
            return 0
        cache = X.wait_for_shards(cache, prompts)  # the capture needs every answer
    texts = cache.get("base", prompts, generate)
    stamp("responses ready")
    grades, passed, labels = X.grade_answers(items, texts)
    n_layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    layers = default_layers(n_layers)
    centroids, caps = X.capture_chunked(model, tok, X.answered(items, texts), range(1, n_layers + 1), layers,
                                        max_length=cfg["capture_length"], out_dir=args.captures_dir, shard=args.shard)
    if args.shard:
        stamp(f"shard {args.shard[0]}/{args.shard[1]} captured into {args.captures_dir}")
        return 0
    stamp("states captured")
    dispersion, res = X.dispersion_by_dataset(items, labels, centroids, layers, n_resamples=args.bootstrap // 4)
    stamp("dispersion measured")
    shape = {"model_name": DEFAULT_MODEL, "hidden_size": hidden, "num_layers": n_layers, "n_components": args.components}
    det = X.detect(items, labels, texts, caps, layers, shape=shape, target_fpr=args.target_fpr,
                   n_resamples=args.bootstrap, setting_rows=arm_idx, progress=lambda m: print(f"# {m}", flush=True))
    res.update(det["figures"])
    stamp("detection done")
    corr = X.corrections(model, tok, det, items, arm_idx, texts, grades, caps, cache, generate, regen_prompts, params,
                         engine_kind=kind, alpha=args.alpha, min_tokens=args.min_tokens, layers=layers,
                         max_length=cfg["capture_length"], n_resamples=args.bootstrap)
    res.update(corr["figures"])
    stamp("corrections done")
    lat_idx = X.latency_rows(arm_idx, prompts, cfg["latency_requests"])
    lat_figs, lat = X.overhead(det["guard"], engine, [items[i]["messages"] for i in lat_idx], model=DEFAULT_MODEL,
                               max_tokens=cfg["max_new_tokens"], threads=cfg["threads"])
    res.update(lat_figs)
    stamp("overhead measured")

    out = X.results(res, det, corr, dispersion, lat, items=items, labels=labels, passed=passed, layers=layers,
                    latency_requests=len(lat_idx), config=X.run_config(DEFAULT_MODEL, kind, cfg, vars(args)),
                    seconds=time.time() - t_start)
    print("\n".join(X.report_lines(out, dispersion, det)))
    out_path = Path(args.out) if args.out else RESULTS / ("guard_quick.json" if args.quick else "guard.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    X.plot_results(out_path.with_suffix(".png"), dispersion, layers, det, labels, corr)
    print(f"results written to {out_path}")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
