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
- "inquant" in the figures above means ``DEFAULT_ARM`` (per-token groups, score gate, the bench's
  calibration), the configuration the arms below found best on this model.
- InQuant arms (issue 23): the model is calibrated once on GSM8K *train* texts (disjoint from the
  few-shot exemplars and test problems; ``llmkit.serving.kv_cache.calibrate``, saved beside the
  model as ``inquant_calibration.safetensors`` and reused). For each key/value layout (per-channel
  groups of ``--group-size`` tokens; per-token groups, no full-precision window) and each gate
  (``none``: no outliers; ``off``: every candidate pair; ``ratio``: the first pass's gate;
  ``score``: the per-head attention-score gate): pairs used, GSM8K-solution perplexity, long-context
  perplexity (``--long-ctx`` tokens of concatenated MATH-500 problems+solutions read back from
  the cache, the next ``--long-tgt`` tokens scored) and bytes per token.
- quantize+dequantize with outliers active: InQuant (gate off, every head keeps ``n_outliers``
  8-bit channels, i.e. ``n_outliers/head_dim`` of the entries) vs the outlier buffer given the
  same fraction of entries as outliers; and the score gate's count vs a matched buffer.
- capacity: sequences of ``--cap-len`` tokens that fit ``--cap-gib`` GiB of KV cache, from the
  bytes each cache holds per token (per-channel layouts charged a full window at bf16), vs bf16.
- served throughput at a fixed KV budget (what ``--serve-bf16-rows`` bf16 sequences of prompt +
  new tokens hold): GSM8K chat requests of mixed lengths arriving ``--serve-gap`` seconds apart
  at the hf engine's streaming batcher, concurrent rows capped at what fits the budget; bf16 vs
  the InQuant cache ``llmkit serve --kv-cache inquant`` builds from the calibration
  (``inquant_serving_factory``), both continuously batched (late requests join running batches).
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
from llmkit.serving.kv_cache import (
    CACHES,
    SERVE_DEFAULTS,
    InQuantCache,
    InQuantCalibration,
    calibrate,
    default_calibration_path,
)
from llmkit.serving.kv_cache import evaluate as kve

DATA = ROOT.parent / "shared" / "data" / "gsm8k"
MATH500 = ROOT.parent / "shared" / "data" / "math500" / "test.jsonl"
METHODS = ["inquant", "kivi", "outlier-buffer"]
LAYOUTS = ("per-channel", "per-token")
GATES = ("none", "off", "ratio", "score")
DEFAULT_ARM = "inquant/per-token/score"  # what "inquant" means in this bench's headline figures
CALIBRATION: InQuantCalibration | None = None  # set in main() once calibrated


def bytes_ids(tok, n: int) -> torch.Tensor:
    """``n`` tokens of MATH-500 text (where bytes per token are measured)."""
    return tok(kve.long_context_text(MATH500, tok, n + 16), return_tensors="pt").input_ids[:, :n]


def arm_cache(arm: str, model, group_size: int):
    """``inquant/<layout>/<gate>``: an InQuant cache using the bench's calibration."""
    _, layout, gate = arm.split("/")
    if gate == "none":
        return InQuantCache(model.config, group_size=group_size, layout=layout, n_outliers=0)
    return InQuantCache(model.config, group_size=group_size, layout=layout, gate=gate, calibration=CALIBRATION)


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
    if name == "inquant" and CALIBRATION is not None:
        return arm_cache(DEFAULT_ARM, model, group_size)
    if name.startswith("inquant/"):
        return arm_cache(name, model, group_size)
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


def perplexity(model, tok, items, context_prefix: str, group_size: int, names) -> dict:
    """Teacher-forced NLL of each reference solution after its context (few-shot exemplars +
    question) read back from each cache (``kv_cache.evaluate.nll_through_caches``)."""
    nll = {n: 0.0 for n in names}
    count = 0
    makers = {n: (None if n == "bf16" else (lambda n=n: make_cache(n, model, group_size))) for n in names}
    for it in tqdm(items, desc="perplexity", unit="problem"):
        ctx = tok(context_prefix + f"Question: {it['question']}\nAnswer:", return_tensors="pt").input_ids
        tgt = tok(" " + it["answer"], return_tensors="pt", add_special_tokens=False).input_ids
        count += tgt.shape[1]
        for n, (v, _) in kve.nll_through_caches(model, ctx, tgt, makers).items():
            nll[n] += v
    return {n: math.exp(v / count) for n, v in nll.items()} | {"tokens": count}


def long_perplexity(model, tok, names, group_size: int, ctx_len: int, tgt_len: int, windows: int) -> dict:
    """Perplexity of ``tgt_len`` tokens after ``ctx_len`` tokens of MATH-500 text read from each
    cache, over ``windows`` texts (MATH-500 rows 0, 50, 100, ...)."""
    nll = {n: 0.0 for n in names}
    count = 0
    makers = {n: (None if n == "bf16" else (lambda n=n: make_cache(n, model, group_size))) for n in names}
    for w in tqdm(range(windows), desc="long-context perplexity", unit="text"):
        text = kve.long_context_text(MATH500, tok, ctx_len + tgt_len + 16, start=50 * w)
        ids = tok(text, return_tensors="pt").input_ids[:, :ctx_len + tgt_len]
        for n, (v, c) in kve.nll_through_caches(model, ids[:, :ctx_len], ids[:, ctx_len:], makers).items():
            nll[n] += v
        count += tgt_len
    return {n: math.exp(v / count) for n, v in nll.items()} | {"tokens": count, "ctx_len": ctx_len, "windows": windows}


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

    prompts = [tok.apply_chat_template([{"role": "user", "content": it["question"]}], tokenize=False,
                                       add_generation_prompt=True) for it in items]
    gold = [it["answer"].split("####")[-1].strip().replace(",", "") for it in items]
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    engines = {name: HFEngine(model, tok, batch_size=batch_size,
                              cache_factory=None if name == "bf16" else (lambda m, name=name: make_cache(name, m, group_size)))
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
    outlier_frac: dict[str, float] = {}
    makers = {"inquant": lambda i: InQuantLayer(group_size, backend="torch"),
              "kivi": lambda i: KIVILayer(group_size),
              "outlier-buffer": lambda i: OutlierBufferLayer(group_size)}
    if CALIBRATION is not None:
        # outliers active: calibrated descriptors (built before timing, as a server holds them),
        # and the outlier buffer given the same fraction of entries as outliers
        D = kv[0][0].shape[-1]
        n_out = 4
        for gate in ("off", "score"):
            descs = [(CALIBRATION.descriptor(i, "k", n_out, 8, gate, "per-channel", group_size),
                      CALIBRATION.descriptor(i, "v", n_out, 8, gate, "per-channel", group_size)) for i in range(len(kv))]
            frac = sum(int(d.pairs_per_head.sum()) for pair in descs for d in pair) / (2 * len(kv) * kv[0][0].shape[1] * D)
            makers[f"inquant/per-channel/{gate}"] = (
                lambda i, gate=gate: InQuantLayer(group_size, n_out, backend="torch", gate=gate,
                                                  calibration=CALIBRATION, layer_idx=i))
            makers[f"outlier-buffer@{gate}"] = lambda i, frac=frac: OutlierBufferLayer(group_size, max(frac, 1e-9))
            outlier_frac[gate] = frac
    best = {}
    for rep in range(reps + 1):  # the first round warms up
        for name, make in makers.items():
            t0 = time.perf_counter()
            for i, (k, v) in enumerate(kv):
                layer = make(i)
                layer.lazy_initialization(k, v)
                layer._append(k, v, group_size)
                layer._dequantize("k")
                layer._dequantize("v")
            dt = time.perf_counter() - t0
            if rep:
                best[name] = min(best.get(name, math.inf), dt)
    return {n: 1e6 * t / T for n, t in best.items()} | {"outlier_frac": outlier_frac}  # us/token (all layers, K+V)


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
        print(f"inquant slot reuse ({DEFAULT_ARM if res.get('calibration') else 'inquant defaults'}): {pairs['k']} key "
              f"and {pairs['v']} value (outlier, donor) pairs used, summed over layers and kv-heads, of "
              f"{pairs['possible']} possible")
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
        for gate, frac in s.get("outlier_frac", {}).items():
            a, b = s[f"inquant/per-channel/{gate}"], s[f"outlier-buffer@{gate}"]
            print(f"quantize+dequantize with outliers (per-channel, gate {gate}, {100 * frac:.2f}% of entries 8-bit "
                  f"in InQuant and in the buffer): InQuant {a:.1f} us/token, outlier-buffer {b:.1f} us/token, "
                  f"speedup {b / a:.2f}x")
            if gate == "off":
                figs["speedup_vs_outlier_buffer_with_outliers"] = round(b / a, 3)
            else:
                figs[f"speedup_vs_outlier_buffer_with_outliers_{gate}"] = round(b / a, 3)
    if "arms" in res:
        arms = res["arms"]
        pb, lb = arms["ppl"]["bf16"], arms["long_ppl"]["bf16"]
        print(f"arms: perplexity bf16 {pb:.4f} on {arms['ppl']['tokens']} GSM8K solution tokens; long-context bf16 "
              f"{lb:.4f} on {arms['long_ppl']['tokens']} tokens after {arms['long_ppl']['ctx_len']} tokens of "
              f"concatenated MATH-500 problems+solutions read from the cache ({arms['long_ppl']['windows']} text(s))")
        for arm, a in arms["per_arm"].items():
            print(f"arm {arm}: pairs used {a['pairs']}/{a['possible']} ({100 * a['pairs_frac']:.1f}%), "
                  f"ppl ratio vs bf16 GSM8K {arms['ppl'][arm] / pb:.4f}, long-context {arms['long_ppl'][arm] / lb:.4f}, "
                  f"{a['bytes_per_token']:.0f} bytes/token held (bf16 {arms['bf16_bytes_per_token']})")
        d = arms["per_arm"][DEFAULT_ARM]
        figs["inquant_pairs_used_frac"] = round(d["pairs_frac"], 4)
        figs["ppl_ratio_inquant_per_token_keys"] = round(arms["ppl"]["inquant/per-token/score"] / pb, 4)
        figs["ppl_ratio_inquant_per_token_keys_no_outliers"] = round(arms["ppl"]["inquant/per-token/none"] / pb, 4)
        figs["long_ppl_ratio_inquant_per_token_keys"] = round(arms["long_ppl"]["inquant/per-token/score"] / lb, 4)
        figs["long_ppl_ratio_inquant_per_token_keys_no_outliers"] = round(arms["long_ppl"]["inquant/per-token/none"] / lb, 4)
    if "capacity" in res:
        c = res["capacity"]
        for n, v in c["sequences"].items():
            w = c["window_bytes"].get(n, 0)
            extra = f", plus a {w / 2**20:.2f} MiB full-precision window per sequence" if w else ""
            print(f"capacity {n}: {v} sequences of {c['seq_len']} tokens in {c['budget_gib']} GiB of KV cache "
                  f"({c['bytes_per_token'][n]:.1f} bytes/token held after {res['bytes_len']} tokens{extra})")
        figs["capacity_ratio_vs_bf16"] = round(c["sequences"]["inquant"] / c["sequences"]["bf16"], 3)
        print(f"capacity InQuant ({DEFAULT_ARM}) / bf16: {figs['capacity_ratio_vs_bf16']:.3f}x")
    if "served" in res:
        sv = res["served"]
        arr = sv.get("arrivals_s")
        how = (f"arrivals staggered {arr[-1] - arr[-2]:.2f} s apart after {arr.count(0.0)} at once, "
               f"{min(sv['new_tokens_each'])}-{max(sv['new_tokens_each'])} new tokens each"
               if arr and len(arr) > 1 else f"all at once, up to {sv['new_tokens']} new each")
        for n, r in sv["results"].items():
            print(f"served at a KV budget of {sv['budget_bytes'] / 2**20:.1f} MiB ({sv['rows']['bf16']} bf16 sequences of "
                  f"{sv['seq_len']} tokens) {n}: {sv['rows'][n]} concurrent rows, {r['tokens_per_s']:.1f} tokens/s "
                  f"({r['tokens']} tokens of {sv['requests']} GSM8K requests, {how}; "
                  f"max batch seen {r['max_batch_seen']}, {r['joined']} joined a running batch)")
        figs["served_throughput_ratio_vs_bf16"] = round(sv["results"]["inquant"]["tokens_per_s"]
                                                        / sv["results"]["bf16"]["tokens_per_s"], 3)
        figs["served_joined_inquant"] = sv["results"]["inquant"]["joined"]
        print(f"served throughput InQuant/bf16 at the same KV budget: {figs['served_throughput_ratio_vs_bf16']:.3f}x")
        if "same_answers" in sv:
            figs["served_same_answer_frac"] = round(sv["same_answers"] / sv["requests"], 4)
            print(f"served answers identical InQuant vs bf16 (greedy): {sv['same_answers']}/{sv['requests']}")
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


def write_plot(res: dict, out: Path) -> None:
    """``<out>.png`` beside a result that has the InQuant arms (``kv_cache.evaluate.plot_results``)."""
    if "arms" in res:
        print(f"plot written to {kve.plot_results(res, out.with_suffix('.png'))}")


def save_partial(res: dict, out: Path) -> None:
    """Write what is measured so far, figures included (a run stopped later still leaves them)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        figs = report(res)
    out.write_text(json.dumps(res | {"figures": figs, "partial": True}, indent=2))


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
    ap.add_argument("--ppl-n", type=int, default=None, help="GSM8K test problems scored (default 8 quick, 40 full)")
    ap.add_argument("--acc-n", type=int, default=None, help="GSM8K test problems generated (default 6 quick, 32 full)")
    ap.add_argument("--acc-start", type=int, default=0, help="first GSM8K test problem of the accuracy run")
    ap.add_argument("--acc-names", default=None,
                    help="caches compared on GSM8K (default bf16,inquant,kivi with --quick, else bf16,inquant)")
    ap.add_argument("--acc-batch", type=int, default=16)
    ap.add_argument("--budget-min", type=float, default=None,
                    help="stop the accuracy run before a batch that would end after this many minutes")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="GSM8K generation cap (default 96 quick, 256 full)")
    ap.add_argument("--compress-len", type=int, default=512)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: ppl,acc,speed,decode,arms,capacity,serve,quanto "
                                                  "(quanto: transformers' QuantizedCache, which compiles optimum-quanto's extension on first use)")
    ap.add_argument("--calib-texts", type=int, default=None, help="GSM8K train texts (4 exemplars each) to calibrate on")
    ap.add_argument("--recalibrate", action="store_true", help="calibrate even if a calibration file exists")
    ap.add_argument("--long-ctx", type=int, default=2048, help="long-context tokens read back from the cache")
    ap.add_argument("--long-tgt", type=int, default=256, help="tokens scored after the long context")
    ap.add_argument("--long-windows", type=int, default=None, help="long-context texts (default 1 quick, 4 full)")
    ap.add_argument("--cap-len", type=int, default=2048, help="sequence length of the capacity figure")
    ap.add_argument("--bytes-len", type=int, default=512,
                    help="prefill length at which bytes/token are measured (a multiple of --group-size: whole groups)")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="KV budget (GiB) of the capacity figure")
    ap.add_argument("--serve-n", type=int, default=None, help="requests served at the KV budget (default 12 quick, 16 full)")
    ap.add_argument("--serve-new", type=int, default=None,
                    help="most new tokens per served request (default 32 quick, 64 full; requests cycle through "
                         "1, 1/2, 3/4, 1/4 of it)")
    ap.add_argument("--serve-gap", type=float, default=1.0,
                    help="seconds between served requests' arrivals after the first --serve-bf16-rows (default 1)")
    ap.add_argument("--serve-bf16-rows", type=int, default=2,
                    help="the served KV budget: what this many bf16 sequences of prompt+new tokens hold")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the figure lines of a results file this script wrote and plot it next to it "
                         "(runs nothing)")
    args = ap.parse_args(argv)
    q = args.quick
    if args.report:
        res = json.loads(Path(args.report).read_text())
        print(json.dumps(report(res)))
        write_plot(res, Path(args.report))
        return 0
    if args.merge:
        res = merge()
        figs = report(res)
        res["figures"] = figs
        out = ROOT / "bench" / "results" / "kv_cache.json"
        out.write_text(json.dumps(res, indent=2))
        print(f"results written to {out}")
        write_plot(res, out)
        print(json.dumps(figs))
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    ppl_n = args.ppl_n or (8 if q else 40)
    acc_n = args.acc_n or (6 if q else 32)
    max_new = args.max_new_tokens or (96 if q else 256)
    acc_names = (args.acc_names or ("bf16,inquant,kivi" if q else "bf16,inquant")).split(",")
    skip = set(filter(None, args.skip.split(",")))
    if args.part == "core":
        skip.add("acc")
    elif args.part == "acc":
        skip |= {"compression", "ppl", "speed", "decode", "arms", "capacity", "serve"}

    model, tok = load(args.model)
    model.eval()
    train, test = read_jsonl(DATA / "train.jsonl"), read_jsonl(DATA / "test.jsonl")
    prefix = fewshot_context(train, args.shots)
    long_text = fewshot_context(train, 12)
    res: dict = {"model": args.model or "smollm2-135m-instruct", "quick": q, "group_size": args.group_size,
                 "dtype": str(model.dtype), "torch_threads": torch.get_num_threads(),
                 "compress_len": args.compress_len, "shots": args.shots, "ppl_n": ppl_n,
                 "max_new_tokens": max_new, "bytes_len": args.bytes_len}
    if args.part == "all":
        out = ROOT / "bench" / "results" / ("kv_cache_quick.json" if q else "kv_cache.json")
    elif args.part == "core":
        out = PARTS / "core.json"
    else:
        out = PARTS / f"acc_{args.acc_start:04d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    global CALIBRATION
    cal_path = default_calibration_path(model)
    n_cal = args.calib_texts or (4 if q else 16)
    saved = InQuantCalibration.load(cal_path) if cal_path.exists() and not args.recalibrate else None
    if saved is not None and saved.meta.get("texts") == n_cal and saved.cache_settings == SERVE_DEFAULTS:
        CALIBRATION = saved
        res["calibration"] = {"path": str(cal_path), "reused": True, **CALIBRATION.meta}
    else:
        # GSM8K train rows 100.. (the few-shot exemplars are rows 0..11), 4 exemplars per text
        texts = [fewshot_context(train[100 + 4 * i:], 4) for i in range(n_cal)]
        t0 = time.perf_counter()
        CALIBRATION = calibrate(model, texts, tok, max_len=512, sample_tokens=512)
        CALIBRATION.save(cal_path)
        res["calibration"] = {"path": str(cal_path), "reused": False, "seconds": time.perf_counter() - t0,
                              **CALIBRATION.meta}
    CALIBRATION.meta["path"] = str(cal_path)
    print(f"InQuant calibration: {res['calibration']['texts']} GSM8K train texts, {res['calibration']['tokens']} "
          f"tokens ({'reused' if res['calibration']['reused'] else 'made'}: {cal_path})")

    if "arms" not in skip:
        arms = [f"inquant/{lay}/{g}" for lay in LAYOUTS for g in GATES]
        kv = kve.prefill_kv(model, bytes_ids(tok, args.bytes_len))
        per_arm = {}
        for arm in arms:
            # the keys/values of a short prefill (whole groups) fix the descriptors and bytes/token
            probe = kve.fill_cache(arm_cache(arm, model, args.group_size), kv)
            pr = probe.outlier_pairs()
            nb = probe.nbytes()
            per_arm[arm] = {"pairs": pr["k"] + pr["v"], "pairs_k": pr["k"], "pairs_v": pr["v"],
                            "possible": pr["possible"],
                            "pairs_frac": (pr["k"] + pr["v"]) / pr["possible"] if pr["possible"] else 0.0,
                            "bytes": nb, "bytes_per_token": nb["total"] / args.bytes_len}
        extra = ["hf-quanto"] if quanto_available() and "quanto" not in skip else []
        base = [n for n in METHODS if n != "inquant"] + extra if "ppl" not in skip else []
        ppl = perplexity(model, tok, test[:ppl_n], prefix, args.group_size, ["bf16", *arms, *base])
        if "ppl" not in skip:  # the baselines' figures come from the same pass (same prefill per problem)
            res["perplexity"] = {n: ppl[n] for n in ["bf16", *base, "tokens"]} | {"inquant": ppl[DEFAULT_ARM]}
            skip.add("ppl")
        res["arms"] = {
            "per_arm": per_arm, "bf16_bytes_per_token": kve.bf16_bytes_per_token(model.config),
            "ppl": {n: ppl[n] for n in ["bf16", *arms, "tokens"]},
            "long_ppl": long_perplexity(model, tok, ["bf16", *arms], args.group_size, args.long_ctx, args.long_tgt,
                                        args.long_windows or (1 if q else 4)),
        }
        save_partial(res, out)

    if "capacity" not in skip:
        kv = kve.prefill_kv(model, bytes_ids(tok, args.bytes_len))
        bpt, window = {"bf16": float(kve.bf16_bytes_per_token(model.config))}, {"bf16": 0}
        for name in ["inquant", "inquant/per-channel/score", "kivi", "outlier-buffer"]:
            b = kve.bytes_per_token(model, lambda name=name: make_cache(name, model, args.group_size), kv=kv)
            bpt[name], window[name] = b["held"], b["window_bytes"]
        budget = int(args.cap_gib * 2**30)
        res["capacity"] = {"seq_len": args.cap_len, "budget_gib": args.cap_gib, "bytes_per_token": bpt,
                           "window_bytes": window,
                           "sequences": {n: kve.capacity(b, budget, args.cap_len, window[n]) for n, b in bpt.items()}}

    if "speed" not in skip:
        res["quant_us_per_token"] = quant_speed(model, tok, long_text, args.compress_len, args.group_size,
                                                reps=2 if q else 5)
        save_partial(res, out)

    if "serve" not in skip:
        from llmkit.serving.kv_cache import inquant_serving_factory

        n_req, n_new = args.serve_n or (12 if q else 16), args.serve_new or (32 if q else 64)
        prompts = [tok.apply_chat_template([{"role": "user", "content": it["question"]}], tokenize=False,
                                           add_generation_prompt=True) for it in test[:n_req]]
        # mixed lengths (rows finish at different steps) and staggered arrivals (requests come in while
        # a batch decodes): later requests join running batches, as on a real server
        news = [max(1, round(n_new * f)) for f in (1.0, 0.5, 0.75, 0.25)] * n_req
        news = news[:n_req]
        arrivals = kve.arrival_offsets(n_req, args.serve_gap, burst=args.serve_bf16_rows)
        seq_len = max(len(tok(p_, add_special_tokens=False).input_ids) for p_ in prompts) + n_new
        budget = args.serve_bf16_rows * seq_len * kve.bf16_bytes_per_token(model.config)
        inq = kve.bytes_per_token(model, lambda: make_cache("inquant", model, args.group_size),
                                  kv=kve.prefill_kv(model, bytes_ids(tok, args.bytes_len)))
        # the cache `llmkit serve --kv-cache inquant` builds from this calibration
        factory, msg = inquant_serving_factory(model, CALIBRATION)
        print(msg)
        probe = factory(model)
        if (probe.layout, probe.gate) != tuple(DEFAULT_ARM.split("/")[1:]) or not probe.rows_mergeable:
            raise SystemExit(f"the serving cache is {probe.layout}/{probe.gate}, not {DEFAULT_ARM} (continuously batched)")
        rows = {"bf16": args.serve_bf16_rows, "inquant": kve.capacity(inq["held"], budget, seq_len, inq["window_bytes"])}
        served = {}
        for name in ("bf16", "inquant"):
            served[name] = kve.served_throughput(model, tok, prompts, news, rows[name],
                                                 None if name == "bf16" else factory, arrivals=arrivals)
        same = sum(a == b for a, b in zip(served["bf16"]["texts"], served["inquant"]["texts"]))
        res["served"] = {"requests": n_req, "new_tokens": n_new, "new_tokens_each": news, "arrivals_s": arrivals,
                         "seq_len": seq_len, "budget_bytes": budget, "rows": rows, "results": served,
                         "same_answers": same, "serving_cache": msg}
        save_partial(res, out)

    if "compression" not in skip:
        res["compression"] = compression(model, tok, long_text, args.compress_len, args.group_size)

        probe = make_cache("inquant", model, args.group_size)
        with torch.inference_mode():
            model(tok(long_text, return_tensors="pt").input_ids[:, :args.compress_len], past_key_values=probe)
        res["inquant_outlier_pairs"] = probe.outlier_pairs()
        save_partial(res, out)

    if "ppl" not in skip:
        extra = ["hf-quanto"] if quanto_available() else []
        if not extra:
            print("transformers QuantizedCache: skipped, optimum-quanto is not installed")
        res["perplexity"] = perplexity(model, tok, test[:ppl_n], prefix, args.group_size, ["bf16", *METHODS, *extra])


    if "decode" not in skip:
        prompts = [prefix[: 600 + 50 * i] for i in range(4)]  # ~150-200 token prompts: packed store in use
        res["decode_tokens_per_s"] = decode_speed(model, tok, prompts, ["bf16", *METHODS], args.group_size,
                                                  48 if q else 128)
        save_partial(res, out)

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
    write_plot(res, out)
    print(json.dumps(figs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
