"""KV-cache quantization benchmark: InQuant vs the unquantized cache, KIVI-4bit and an outlier buffer.

Run: ``.venv/bin/python bench/kv_cache.py [--quick]`` (bundled SmolLM2-135M, CPU). The full run
can be split into pieces that each fit a time slot: ``--part core`` (compression, perplexity,
quant speed, decode), then ``--part acc --acc-start S [--budget-min M]`` as often as needed (each
stops before a batch that would overrun ``M`` minutes and records how many problems it did; the
next starts where it stopped), then ``--merge`` prints every figure and writes kv_cache.json.

Figures (each measured against its anchor in the same run):

- compression: bytes a bf16 cache would hold / bytes the cache holds, after a prefill of
  ``--compress-len`` tokens (a multiple of the group size, so the full-precision window is empty):
  ``packed`` counts the packed codes only, ``total`` adds scales, zero-points and descriptors.
- perplexity (teacher-forced, GSM8K test solutions): the context (``--shots`` GSM8K train
  exemplars + the test question) is prefilled into the cache and ``flush()``-ed, so all of it is
  read back from the quantized store; then the reference solution is scored in one forward pass
  reading that quantized past (the solution's own tokens attend to each other unquantized, as in
  any forward pass). The context's keys/values are computed once (unquantized cache) and
  written into each cache with ``cache.update``, which is what the model's prefill does (identical
  NLL, checked). ppl = exp(mean NLL over all solution tokens); ratios vs the unquantized
  ``DynamicCache`` ("bf16" in the names; on CPU the model and that cache run in float32).
  ``hf-quanto`` is transformers' ``QuantizedCache("quanto", nbits=4)`` when optimum-quanto is
  installed (its first update quantizes the whole prefill, so it reads the context quantized too).
- GSM8K greedy accuracy (zero-shot chat prompt, last number in the completion vs the gold answer)
  with each cache in ``model.generate`` (batched, 16 prompts per call; each batch runs every cache
  before the next batch starts, so a part stopped by its budget compares caches on the same problems).
- quantize+dequantize time per token: the keys/values of every layer after a prefill, quantized
  into a fresh layer (InQuant includes its saliency sampling and descriptor build) and
  dequantized once; PyTorch CPU path; ratio outlier-buffer time / InQuant time.
- decode tokens/s with each cache vs the unquantized cache (``generate``, greedy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from llmkit.models import load
from llmkit.serving.kv_cache import CACHES

DATA = ROOT.parent / "shared" / "data" / "gsm8k"
METHODS = ["inquant", "kivi", "outlier-buffer"]


def read_jsonl(path: Path, n: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def fewshot_context(train: list[dict], shots: int) -> str:
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:shots])


def quanto_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def make_cache(name, model, group_size):
    if name == "hf-quanto":  # transformers' own QuantizedCache (quanto backend, 4-bit, its defaults)
        from transformers import QuantizedCache

        return QuantizedCache("quanto", model.config, nbits=4)
    return None if name == "bf16" else CACHES[name](model.config, group_size=group_size)


# ------------------------------------------------------------------------------ compression


@torch.inference_mode()
def compression(model, tok, text: str, length: int, group_size: int) -> dict:
    ids = tok(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise SystemExit(f"compression text has only {ids.shape[1]} tokens, need {length}")
    out = {}
    for name in METHODS:
        cache = make_cache(name, model, group_size)
        model(ids, past_key_values=cache, use_cache=True)
        nb, ref = cache.nbytes(), cache.bf16_nbytes()
        out[name] = {
            "bytes": nb, "bf16_bytes": ref,
            "packed": ref / nb["packed"],
            "total": ref / (nb["total"] - nb["window"]),
            "held": ref / nb["total"],
        }
    return out


# ------------------------------------------------------------------------------ perplexity


@torch.inference_mode()
def perplexity(model, tok, items, context_prefix: str, group_size: int, names, shared_prefill: bool = True) -> dict:
    """Teacher-forced NLL of each reference solution after a context read back from each cache.

    ``shared_prefill``: the context's keys/values and its last logits do not depend on the cache
    (a forward pass attends to its own tokens unquantized and ``update`` returns them as given),
    so the context is run once through an unquantized cache and its per-layer keys/values are
    written into each cache with ``cache.update`` -- the same calls the model's own prefill makes.
    ``False`` runs the prefill through every cache (same result, ~len(names) times the cost)."""
    from transformers import DynamicCache

    nll = {n: 0.0 for n in names}
    count = 0
    for it in tqdm(items, desc="perplexity", unit="problem"):
        ctx = tok(context_prefix + f"Question: {it['question']}\nAnswer:", return_tensors="pt").input_ids
        tgt = tok(" " + it["answer"], return_tensors="pt", add_special_tokens=False).input_ids
        count += tgt.shape[1]
        if shared_prefill:
            ref = DynamicCache(config=model.config)
            first = model(ctx, past_key_values=ref, use_cache=True).logits[:, -1:]
            kv = [(layer.keys, layer.values) for layer in ref.layers]
        for name in names:
            cache = make_cache(name, model, group_size)
            if cache is None:
                cache = DynamicCache(config=model.config)
            if shared_prefill:
                for i, (k, v) in enumerate(kv):
                    cache.update(k, v, i)
            else:
                first = model(ctx, past_key_values=cache, use_cache=True).logits[:, -1:]
            if hasattr(cache, "flush"):
                cache.flush()
            rest = model(tgt, past_key_values=cache, use_cache=True).logits[:, :-1]
            logits = torch.cat([first, rest], dim=1).float()
            nll[name] += torch.nn.functional.cross_entropy(logits[0], tgt[0], reduction="sum").item()
    return {n: math.exp(v / count) for n, v in nll.items()} | {"tokens": count}


# ------------------------------------------------------------------------------ accuracy


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def accuracy(model, tok, items, names, group_size, max_new_tokens, batch_size, start: int = 0,
             budget_s: float | None = None, save=None) -> dict:
    """Greedy GSM8K accuracy per cache, batch by batch: every name runs on a batch before the next
    batch starts, so a run stopped by ``budget_s`` (seconds; a batch is not started when the
    slowest batch so far would overrun it) still compares all names on the same problems.
    ``save(partial_result)`` is called after each batch. Per-problem correctness is kept under
    ``ok`` (problem ``start + i``) so parts can be merged."""
    from llmkit.engines.hf import HFEngine
    from llmkit.generation import GenerationParams
    from llmkit.serving.kv_cache import cache_factory

    prompts = [tok.apply_chat_template([{"role": "user", "content": it["question"]}], tokenize=False,
                                       add_generation_prompt=True) for it in items]
    gold = [it["answer"].split("####")[-1].strip().replace(",", "") for it in items]
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    engines = {name: HFEngine(model, tok, batch_size=batch_size,
                              cache_factory=None if name == "bf16" else cache_factory(name, group_size=group_size))
               for name in names}
    out = {"start": start, "ok": {n: [] for n in names}, "seconds": {n: 0.0 for n in names}}
    t_start, slowest = time.perf_counter(), 0.0
    for b in tqdm(range(0, len(items), batch_size), desc="gsm8k batches"):
        if budget_s is not None and time.perf_counter() - t_start + slowest > budget_s:
            print(f"gsm8k: time budget reached after {b} problems", flush=True)
            break
        t_batch = time.perf_counter()
        for name in names:
            t0 = time.perf_counter()
            comps = engines[name].generate(prompts[b:b + batch_size], params)
            out["seconds"][name] += time.perf_counter() - t0
            out["ok"][name] += [same_number(last_number(c[0].text), g) for c, g in zip(comps, gold[b:b + batch_size])]
        slowest = max(slowest, time.perf_counter() - t_batch)
        if save is not None:
            save(summarize_accuracy(out))
    return summarize_accuracy(out)


def summarize_accuracy(a: dict) -> dict:
    names = list(a["ok"])
    n = len(a["ok"][names[0]]) if names else 0
    out = {k: a[k] for k in ("start", "ok", "seconds") if k in a} | {"n": n}
    for name in names:
        c = sum(a["ok"][name])
        out[name] = {"accuracy": 100.0 * c / n if n else float("nan"), "correct": c}
    return out


def merge_accuracy(parts: list[dict]) -> dict:
    """Concatenate per-problem results of parts covering consecutive problem ranges."""
    parts = sorted(parts, key=lambda p: p["start"])
    names = [n for n in parts[0]["ok"] if all(n in p["ok"] for p in parts)]
    merged = {"start": parts[0]["start"], "ok": {n: [] for n in names}, "seconds": {n: 0.0 for n in names}}
    nxt = parts[0]["start"]
    for p in parts:
        if p["start"] != nxt:
            raise SystemExit(f"gsm8k parts are not consecutive: expected a part starting at {nxt}, got {p['start']}")
        for n in names:
            merged["ok"][n] += p["ok"][n]
            merged["seconds"][n] += p["seconds"][n]
        nxt = p["start"] + p["n"]
    return summarize_accuracy(merged)


# ------------------------------------------------------------------------------ speed


@torch.inference_mode()
def quant_speed(model, tok, text: str, length: int, group_size: int, reps: int) -> dict:
    from transformers import DynamicCache

    from llmkit.serving.kv_cache.layers import InQuantLayer, KIVILayer, OutlierBufferLayer

    ids = tok(text, return_tensors="pt").input_ids[:, :length]
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref, use_cache=True)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in ref.layers]
    T = kv[0][0].shape[-2]
    makers = {"inquant": lambda: InQuantLayer(group_size, backend="torch"),
              "kivi": lambda: KIVILayer(group_size),
              "outlier-buffer": lambda: OutlierBufferLayer(group_size)}
    best = {}
    for rep in range(reps + 1):  # the first round warms up
        for name, make in makers.items():
            t0 = time.perf_counter()
            for k, v in kv:
                layer = make()
                layer.lazy_initialization(k, v)
                layer._append(k, v, group_size)
                layer._dequantize("k")
                layer._dequantize("v")
            dt = time.perf_counter() - t0
            if rep:
                best[name] = min(best.get(name, math.inf), dt)
    return {n: 1e6 * t / T for n, t in best.items()}  # microseconds per token (all layers, K+V)


@torch.inference_mode()
def decode_speed(model, tok, prompts, names, group_size, new_tokens) -> dict:
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    tok.padding_side = side
    out = {}
    for name in names:
        kw = {}
        best = math.inf
        for _ in range(2):
            if name != "bf16":
                kw["past_key_values"] = make_cache(name, model, group_size)
            t0 = time.perf_counter()
            gen = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, **kw)
            best = min(best, time.perf_counter() - t0)
        n_new = (gen.shape[1] - enc.input_ids.shape[1]) * gen.shape[0]
        out[name] = n_new / best
    return out


# ------------------------------------------------------------------------------ main


def report(res: dict) -> dict:
    """Print one line per figure for the sections ``res`` holds; return the summary figures."""
    figs: dict = {}
    q = res["quick"]
    if "compression" in res:
        c = res["compression"]
        for n in METHODS:
            print(f"compression {n}: packed {c[n]['packed']:.3f}x, total (packed+scales+descriptors"
                  f"{'+outlier buffer' if n == 'outlier-buffer' else ''}) {c[n]['total']:.3f}x vs bf16 "
                  f"at {res['compress_len']} tokens")
        pairs = res["inquant_outlier_pairs"]
        print(f"inquant slot reuse: {pairs['k']} key and {pairs['v']} value (outlier, donor) pairs kept per kv-head "
              f"over all layers, of {pairs['possible']} possible (the rest did not pay, see inquant.py)")
        figs["compression_packed"] = round(c["inquant"]["packed"], 4)
        figs["compression_total"] = round(c["inquant"]["total"], 4)
    if "perplexity" in res:
        p = res["perplexity"]
        print(f"perplexity bf16 (unquantized cache): {p['bf16']:.4f} on {p['tokens']} solution tokens "
              f"of {res['ppl_n']} GSM8K test problems ({res['shots']}-shot context read from the cache)")
        for n in p:
            if n in ("bf16", "tokens"):
                continue
            r = p[n] / p["bf16"]
            print(f"perplexity {n}: {p[n]:.4f} (ratio vs bf16 {r:.4f})")
            figs[f"ppl_ratio_{n.replace('-', '_')}"] = round(r, 4)
    if "quant_us_per_token" in res:
        s = res["quant_us_per_token"]
        for n in METHODS:
            print(f"quantize+dequantize {n}: {s[n]:.1f} us/token (all layers, K+V, PyTorch CPU)")
        figs["speedup_vs_outlier_buffer"] = round(s["outlier-buffer"] / s["inquant"], 3)
        print(f"quantize+dequantize speedup InQuant vs outlier-buffer: {figs['speedup_vs_outlier_buffer']:.2f}x")
    if "decode_tokens_per_s" in res:
        d = res["decode_tokens_per_s"]
        for n in ["bf16", *METHODS]:
            print(f"decode {n}: {d[n]:.1f} tokens/s (batch 4, greedy)")
        figs["decode_ratio_vs_bf16"] = round(d["inquant"] / d["bf16"], 3)
        print(f"decode InQuant/bf16 tokens/s ratio: {figs['decode_ratio_vs_bf16']:.3f}")
    if "gsm8k" in res:
        a = res["gsm8k"]
        first, last = a["start"], a["start"] + a["n"] - 1
        for n in a["ok"]:
            print(f"gsm8k greedy accuracy {n}: {a[n]['accuracy']:.2f}% ({a[n]['correct']}/{a['n']}, test problems "
                  f"{first}..{last}{', quick subset' if q else ''}, max {res['max_new_tokens']} new tokens, "
                  f"{a['seconds'][n]:.0f} s)")
        if "inquant" in a and "bf16" in a:
            figs["gsm8k_acc_bf16"] = a["bf16"]["accuracy"]
            figs["gsm8k_acc_inquant"] = a["inquant"]["accuracy"]
            figs["gsm8k_acc_delta_inquant"] = round(a["inquant"]["accuracy"] - a["bf16"]["accuracy"], 2)
        figs["gsm8k_n"] = a["n"]
    return figs


PARTS = ROOT / "bench" / "results" / "kv_cache_parts"


def merge() -> dict:
    """Combine ``kv_cache_parts/core.json`` and ``kv_cache_parts/acc_*.json`` into one result."""
    accs = [json.loads(f.read_text()) for f in sorted(PARTS.glob("acc_*.json"))]
    if (PARTS / "core.json").exists():
        res = json.loads((PARTS / "core.json").read_text())
    elif accs:  # accuracy only: the core part has not been run
        res = {k: v for k, v in accs[0].items() if k != "gsm8k"}
        print("kv_cache_parts/core.json is missing: compression, perplexity, speed and decode not included")
    else:
        raise SystemExit(f"nothing to merge in {PARTS}")
    if accs:
        res["gsm8k"] = merge_accuracy([a["gsm8k"] for a in accs])
        res["max_new_tokens"] = accs[0]["max_new_tokens"]
        if any(a["max_new_tokens"] != res["max_new_tokens"] for a in accs):
            raise SystemExit("gsm8k parts used different --max-new-tokens")
    res["parts"] = [f.name for f in sorted(PARTS.glob("*.json"))]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer problems, shorter runs")
    ap.add_argument("--part", choices=["all", "core", "acc"], default="all",
                    help="core: compression, perplexity, quant speed, decode -> kv_cache_parts/core.json; "
                         "acc: GSM8K accuracy from --acc-start -> kv_cache_parts/acc_<start>.json; "
                         "all: everything in one process")
    ap.add_argument("--merge", action="store_true",
                    help="combine kv_cache_parts/*.json into kv_cache.json (runs nothing)")
    ap.add_argument("--model", default=None, help="model name/path (default: the bundled model)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--shots", type=int, default=3, help="train exemplars before each scored question")
    ap.add_argument("--ppl-n", type=int, default=None)
    ap.add_argument("--acc-n", type=int, default=None)
    ap.add_argument("--acc-start", type=int, default=0, help="first GSM8K test problem of the accuracy run")
    ap.add_argument("--acc-names", default=None,
                    help="caches compared on GSM8K (default bf16,inquant,kivi with --quick, else bf16,inquant)")
    ap.add_argument("--acc-batch", type=int, default=16)
    ap.add_argument("--budget-min", type=float, default=None,
                    help="stop the accuracy run before a batch that would end after this many minutes")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--compress-len", type=int, default=512)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: ppl,acc,speed,decode")
    args = ap.parse_args(argv)
    q = args.quick
    if args.merge:
        res = merge()
        figs = report(res)
        res["figures"] = figs
        out = ROOT / "bench" / "results" / "kv_cache.json"
        out.write_text(json.dumps(res, indent=2))
        print(f"results written to {out}")
        print(json.dumps(figs))
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    ppl_n = args.ppl_n or (3 if q else 100)
    acc_n = args.acc_n or (6 if q else 200)
    max_new = args.max_new_tokens or (96 if q else 320)
    acc_names = (args.acc_names or ("bf16,inquant,kivi" if q else "bf16,inquant")).split(",")
    skip = set(filter(None, args.skip.split(",")))
    if args.part == "core":
        skip.add("acc")
    elif args.part == "acc":
        skip |= {"compression", "ppl", "speed", "decode"}

    model, tok = load(args.model)
    model.eval()
    train, test = read_jsonl(DATA / "train.jsonl"), read_jsonl(DATA / "test.jsonl")
    prefix = fewshot_context(train, args.shots)
    long_text = fewshot_context(train, 12)
    res: dict = {"model": args.model or "smollm2-135m-instruct", "quick": q, "group_size": args.group_size,
                 "dtype": str(model.dtype), "torch_threads": torch.get_num_threads(),
                 "compress_len": args.compress_len, "shots": args.shots, "ppl_n": ppl_n,
                 "max_new_tokens": max_new}
    if args.part == "all":
        out = ROOT / "bench" / "results" / ("kv_cache_quick.json" if q else "kv_cache.json")
    elif args.part == "core":
        out = PARTS / "core.json"
    else:
        out = PARTS / f"acc_{args.acc_start:04d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    if "compression" not in skip:
        res["compression"] = compression(model, tok, long_text, args.compress_len, args.group_size)
        from llmkit.serving.kv_cache import InQuantCache

        probe = InQuantCache(model.config)
        with torch.inference_mode():
            model(tok(long_text, return_tensors="pt").input_ids[:, :args.compress_len], past_key_values=probe)
        res["inquant_outlier_pairs"] = probe.outlier_pairs()

    if "ppl" not in skip:
        extra = ["hf-quanto"] if quanto_available() else []
        if not extra:
            print("transformers QuantizedCache: skipped, optimum-quanto is not installed")
        res["perplexity"] = perplexity(model, tok, test[:ppl_n], prefix, args.group_size, ["bf16", *METHODS, *extra])

    if "speed" not in skip:
        res["quant_us_per_token"] = quant_speed(model, tok, long_text, args.compress_len, args.group_size,
                                                reps=2 if q else 5)

    if "decode" not in skip:
        prompts = [prefix[: 600 + 50 * i] for i in range(4)]  # ~150-200 token prompts: packed store in use
        res["decode_tokens_per_s"] = decode_speed(model, tok, prompts, ["bf16", *METHODS], args.group_size,
                                                  48 if q else 128)

    if "acc" not in skip:
        items = test[args.acc_start:args.acc_start + acc_n]

        def save(partial):
            out.write_text(json.dumps(res | {"gsm8k": partial}, indent=2))

        res["gsm8k"] = accuracy(model, tok, items, acc_names, args.group_size, max_new, args.acc_batch,
                                start=args.acc_start,
                                budget_s=None if args.budget_min is None else 60 * args.budget_min,
                                save=save if args.part == "acc" else None)

    figs = report(res)
    res["figures"] = figs
    out.write_text(json.dumps(res, indent=2))
    print(f"results written to {out}")
    print(json.dumps(figs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
