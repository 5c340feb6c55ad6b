"""InQuant's benchmark (``bench/kv_cache.py``): workloads, arms, baselines and figures, on a real model.

Every figure is measured against its anchor in the same run; the committed figures and their
command are on bench/results/kv_cache.md. The sections (each a function here, each a key of the
results JSON):

- ``compression``: bytes a bf16 cache would hold / bytes the cache holds after a prefill of whole groups.
- ``perplexity`` and ``arms``: teacher-forced perplexity of GSM8K test solutions whose context (few-shot
  GSM8K train exemplars + question) is read back from each cache (:func:`nll_through_caches`), and of a
  long MATH-500 text (:func:`long_context_text`); ``arms`` crosses InQuant's key/value layouts
  (per-channel groups, per-token groups) with its gates (``none``: no outliers, ``off``, ``ratio``,
  ``score``) on one calibration made from GSM8K train texts disjoint from the exemplars and test problems.
- ``quant_us_per_token``: quantize + dequantize time per token against the outlier buffer, with and
  without outliers in use (PyTorch CPU path).
- ``capacity``: sequences of a given length that fit a KV budget, from the bytes each cache holds per
  token (:func:`bytes_per_token`; per-channel layouts are charged a full-precision window at bf16).
- ``served``: GSM8K chat requests of mixed lengths arriving staggered at the hf engine's streaming
  batcher, concurrent rows capped at what a fixed KV budget allows, bf16 vs the InQuant cache that
  ``llmkit serve --kv-cache inquant`` builds from the calibration (:func:`served_throughput`).
- ``decode_tokens_per_s``: ``generate`` tokens/s with each cache vs the unquantized one.
- ``gsm8k``: greedy accuracy with each cache, batch by batch, so a run cut short still compares the caches
  on the same problems and several parts (``acc_<start>``) merge into one range (:func:`merge_parts`).

"bf16" names transformers' unquantized ``DynamicCache`` (float32 on CPU); "inquant" in the headline
figures means :data:`DEFAULT_ARM`, the setting ``llmkit serve --kv-cache inquant`` uses; the page says how
it compares with the other arms. A run keeps its parts in a :class:`~llmkit.experiments.harness.ResultStore`
keyed by its settings (:func:`settings`): rerunning a command that was cut short continues after the
last finished section (or GSM8K batch).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from llmkit.experiments.harness import ResultStore, write_json
from llmkit.serving.kv_cache import (
    CACHES,
    SERVE_DEFAULTS,
    InQuantCache,
    InQuantCalibration,
    calibrate,
    default_calibration_path,
    inquant_serving_factory,
)
from llmkit.serving.kv_cache.layers import InQuantLayer, KIVILayer, OutlierBufferLayer

METHODS = ["inquant", "kivi", "outlier-buffer"]
LAYOUTS = ("per-channel", "per-token")
GATES = ("none", "off", "ratio", "score")
ARMS = [f"inquant/{lay}/{g}" for lay in LAYOUTS for g in GATES]
DEFAULT_ARM = "inquant/per-token/score"  # what "inquant" means in the headline figures: the serving default

# ------------------------------------------------------------------------------ measuring through a cache


@torch.inference_mode()
def nll_through_caches(model, ctx_ids: torch.Tensor, tgt_ids: torch.Tensor,
                       makers: dict[str, Callable | None]) -> dict[str, tuple[float, int]]:
    """Summed NLL of ``tgt_ids [1, n]`` after ``ctx_ids [1, m]`` read back from each cache
    (``makers[name]() -> Cache``; ``None`` = transformers' unquantized ``DynamicCache``)."""
    if ctx_ids.dim() != 2 or tgt_ids.dim() != 2 or ctx_ids.shape[0] != 1 or tgt_ids.shape[0] != 1:
        raise ValueError(f"ctx_ids and tgt_ids must be [1, n], got {tuple(ctx_ids.shape)} and {tuple(tgt_ids.shape)}")
    ref = DynamicCache(config=model.config)
    first = model(ctx_ids, past_key_values=ref, use_cache=True).logits[:, -1:]
    kv = [(layer.keys, layer.values) for layer in ref.layers]
    out = {}
    for name, make in makers.items():
        cache = DynamicCache(config=model.config) if make is None else make()
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        if hasattr(cache, "flush"):
            cache.flush()
        rest = model(tgt_ids, past_key_values=cache, use_cache=True).logits[:, :-1]
        logits = torch.cat([first, rest], dim=1).float()
        nll = torch.nn.functional.cross_entropy(logits[0], tgt_ids[0], reduction="sum").item()
        out[name] = (nll, tgt_ids.shape[1])
    return out


def long_context_text(math500_jsonl: str | Path, tokenizer, min_tokens: int = 2304, start: int = 0) -> str:
    """Concatenated ``Problem: ...\\nSolution: ...`` entries of MATH-500 from ``start`` until the
    text has at least ``min_tokens`` tokens."""
    path = Path(math500_jsonl)
    if not path.is_file():
        raise FileNotFoundError(f"MATH-500 file not found: {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    parts, n = [], 0
    for r in rows[start:]:
        part = f"Problem: {r['problem']}\nSolution: {r['solution']}\n\n"
        parts.append(part)
        n += len(tokenizer(part, add_special_tokens=False).input_ids)
        if n >= min_tokens:
            return "".join(parts)
    raise ValueError(f"MATH-500 from row {start} gives only {n} tokens, fewer than {min_tokens}")


def bf16_bytes_per_token(config) -> int:
    """Bytes a bf16 cache holds per token: K and V, 2 bytes each, every layer and kv-head."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim


@torch.inference_mode()
def prefill_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of ``ids`` from one unquantized forward pass."""
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref, use_cache=True)
    return [(layer.keys, layer.values) for layer in ref.layers]


def fill_cache(cache, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """Write precomputed per-layer keys/values into ``cache`` (the calls a prefill makes)."""
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def bytes_per_token(model, make_cache: Callable, ids: torch.Tensor | None = None,
                    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, float]:
    """Prefill ``ids [1, L]`` (or write ``kv`` from :func:`prefill_kv`) into ``make_cache()`` with
    ``L`` a multiple of the group size, and report ``held`` (bytes per token the quantized store
    holds, all kinds, the full-precision window left out) and ``window_bytes`` (per sequence: a
    full-precision window at its fullest, ``group_size - 1`` tokens at 2 bytes per element; 0
    for caches without a window)."""
    cache = make_cache()
    if kv is None:
        model(ids, past_key_values=cache, use_cache=True)
        L = ids.shape[1]
    else:
        fill_cache(cache, kv)
        L = kv[0][0].shape[-2]
    nb = cache.nbytes()
    held = (nb["total"] - nb.get("window", 0)) / L
    window_tokens = max((getattr(layer, "group_size", 1) - 1 for layer in cache.layers), default=0)
    return {"held": held, "window_bytes": window_tokens * bf16_bytes_per_token(model.config), "tokens": L}


def capacity(bytes_per_tok: float, budget_bytes: int, seq_len: int, window_bytes: float = 0.0) -> int:
    """Concurrent sequences of ``seq_len`` tokens that fit ``budget_bytes`` of KV cache, each
    holding ``bytes_per_tok`` per token plus ``window_bytes`` (a full-precision window)."""
    if bytes_per_tok <= 0 or seq_len <= 0 or budget_bytes <= 0 or window_bytes < 0:
        raise ValueError(f"capacity needs positive bytes/token, length and budget (and window bytes >= 0), got "
                         f"{bytes_per_tok}, {seq_len}, {budget_bytes}, {window_bytes}")
    return math.floor(budget_bytes / (bytes_per_tok * seq_len + window_bytes))


def arrival_offsets(n: int, gap_s: float, burst: int = 1) -> list[float]:
    """Submission times (seconds after the start) of ``n`` requests: ``burst`` at once, then one
    every ``gap_s`` seconds, so later requests arrive while earlier ones decode."""
    if n < 0 or gap_s < 0 or burst < 1:
        raise ValueError(f"arrival_offsets needs n >= 0, gap_s >= 0, burst >= 1, got {n}, {gap_s}, {burst}")
    return [max(0, i - burst + 1) * gap_s for i in range(n)]


def served_throughput(model, tokenizer, prompts: list[str], max_new_tokens: int | list[int], max_batch_size: int,
                      cache_factory=None, timeout_s: float = 1800.0, arrivals: list[float] | None = None) -> dict:
    """Serve ``prompts`` through the hf engine's streaming batcher with at most ``max_batch_size``
    concurrent rows (what a KV budget allows), greedy, up to ``max_new_tokens`` each (one number,
    or one per prompt; a row that reaches EOS stops early; tokens are counted as produced).

    ``arrivals`` (seconds after the start, one per prompt; default all at 0) staggers submissions:
    a request that arrives while a batch runs joins it at the next step when the cache's rows can
    be merged (continuous batching), and ``joined`` counts those. Returns generated tokens,
    seconds (first submission to last answer), tokens/s, the batcher's counters and each answer's
    ``texts`` (prompt order)."""
    from llmkit.engines.hf import HFEngine
    from llmkit.engines.stream import StreamRequest
    from llmkit.generation import GenerationParams

    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    news = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    arrivals = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    if len(news) != len(prompts) or len(arrivals) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(news)} max_new_tokens and {len(arrivals)} arrivals")
    if any(t < 0 for t in arrivals) or any(n < 1 for n in news):
        raise ValueError("arrivals must be >= 0 and max_new_tokens >= 1")
    loop = HFEngine(model, tokenizer, cache_factory=cache_factory).start_streaming(max_batch_size=max_batch_size)
    done, counts, texts, lock = threading.Event(), {}, {}, threading.Lock()
    errors = []

    def on_event(i):
        parts = []

        def f(ev):
            parts.append(ev.text or "")
            if ev.finish_reason:
                with lock:
                    counts[i], texts[i] = ev.n_tokens, "".join(parts)
                    if ev.error:
                        errors.append(ev.error)
                    if len(counts) == len(prompts):
                        done.set()
        return f

    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    ids = {i: tokenizer(prompts[i], add_special_tokens=False)["input_ids"] for i in order}
    t0 = time.perf_counter()
    try:
        for i in order:
            wait = t0 + arrivals[i] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            loop.submit(StreamRequest(ids[i], GenerationParams(max_new_tokens=news[i]), on_event(i)))
        if not done.wait(timeout_s):
            raise TimeoutError(f"served_throughput: {len(prompts) - len(counts)} requests unfinished after {timeout_s} s")
    finally:
        loop.stop()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"served_throughput: a request failed: {errors[0]}")
    n = sum(counts.values())
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "max_batch_size": max_batch_size,
            "max_batch_seen": loop.max_batch_seen, "joined": loop.joined, "batches": loop.batches,
            "texts": [texts[i] for i in range(len(prompts))]}


# ------------------------------------------------------------------------------ workload


def read_jsonl(path: Path, n: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


def fewshot_context(train: list[dict], shots: int) -> str:
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:shots])


def chat_prompts(tok, items: list[dict]) -> list[str]:
    """Zero-shot chat prompts of GSM8K questions, as a user would send them."""
    return [tok.apply_chat_template([{"role": "user", "content": it["question"]}], tokenize=False,
                                    add_generation_prompt=True) for it in items]


def bytes_ids(tok, n: int, math500: Path) -> torch.Tensor:
    """``n`` tokens of MATH-500 text (where bytes per token are measured)."""
    return tok(long_context_text(math500, tok, n + 16), return_tensors="pt").input_ids[:, :n]


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def quanto_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


@dataclass
class Caches:
    """Builds every cache the bench compares by name: ``bf16`` (``None``: transformers' default),
    ``inquant`` (:data:`DEFAULT_ARM` once calibrated, InQuant's defaults without), an arm
    ``inquant/<layout>/<gate>``, a baseline of ``llmkit.serving.kv_cache.CACHES`` or ``hf-quanto``
    (transformers' ``QuantizedCache``, quanto backend, 4-bit, its defaults)."""

    model: object
    group_size: int
    calibration: object | None = None

    def arm(self, arm: str, model=None):
        config = (model or self.model).config
        _, layout, gate = arm.split("/")
        if gate == "none":
            return InQuantCache(config, group_size=self.group_size, layout=layout, n_outliers=0)
        return InQuantCache(config, group_size=self.group_size, layout=layout, gate=gate, calibration=self.calibration)

    def make(self, name: str, model=None):
        model = model or self.model
        if name == "hf-quanto":
            from transformers import QuantizedCache

            return QuantizedCache("quanto", model.config, nbits=4)
        if name == "inquant" and self.calibration is not None:
            return self.arm(DEFAULT_ARM, model)
        if name.startswith("inquant/"):
            return self.arm(name, model)
        return None if name == "bf16" else CACHES[name](model.config, group_size=self.group_size)

    def makers(self, names) -> dict[str, Callable | None]:
        """``{name: () -> Cache}`` for :func:`nll_through_caches` (``None`` for bf16)."""
        return {n: (None if n == "bf16" else (lambda n=n: self.make(n))) for n in names}

    def engine_factory(self, name: str):
        """``(model) -> Cache`` for the hf engine (``None`` for bf16)."""
        return None if name == "bf16" else (lambda m, name=name: self.make(name, m))


def calibrate_or_reuse(model, tok, train: list[dict], n_texts: int, recalibrate: bool = False):
    """The model's saved InQuant calibration when it was made from ``n_texts`` texts with the serving
    defaults, else a new one (saved where ``llmkit serve`` looks): ``(calibration, info)``.

    Calibration texts are GSM8K train rows 100.. (the few-shot exemplars are rows 0..11), 4 exemplars each.
    """
    path = default_calibration_path(model)
    saved = InQuantCalibration.load(path) if path.exists() and not recalibrate else None
    if saved is not None and saved.meta.get("texts") == n_texts and saved.cache_settings == SERVE_DEFAULTS:
        cal, info = saved, {"path": str(path), "reused": True, **saved.meta}
    else:
        texts = [fewshot_context(train[100 + 4 * i:], 4) for i in range(n_texts)]
        t0 = time.perf_counter()
        cal = calibrate(model, texts, tok, max_len=512, sample_tokens=512)
        cal.save(path)
        info = {"path": str(path), "reused": False, "seconds": time.perf_counter() - t0, **cal.meta}
    cal.meta["path"] = str(path)
    return cal, info


# ------------------------------------------------------------------------------ sections


@torch.inference_mode()
def compression(model, tok, text: str, length: int, caches: Caches) -> dict:
    """Per method: ``bf16 bytes / bytes held`` after a prefill of ``length`` tokens (a multiple of the group
    size, so the window is empty): ``packed`` (codes only), ``total`` (+ scales, zero-points, descriptors,
    outlier buffer), ``held`` (+ the window)."""
    ids = tok(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"compression text has only {ids.shape[1]} tokens, need {length}")
    out = {}
    for name in METHODS:
        cache = caches.make(name)
        model(ids, past_key_values=cache, use_cache=True)
        nb, ref = cache.nbytes(), cache.bf16_nbytes()
        out[name] = {
            "bytes": nb, "bf16_bytes": ref,
            "packed": ref / nb["packed"],
            "total": ref / (nb["total"] - nb["window"]),
            "held": ref / nb["total"],
        }
    return out


@torch.inference_mode()
def outlier_pairs(model, tok, text: str, length: int, caches: Caches) -> dict:
    """(outlier, donor) pairs the headline InQuant cache uses after a prefill of ``length`` tokens."""
    probe = caches.make("inquant")
    model(tok(text, return_tensors="pt").input_ids[:, :length], past_key_values=probe)
    return probe.outlier_pairs()


def perplexity(model, tok, items, context_prefix: str, caches: Caches, names) -> dict:
    """Teacher-forced perplexity of each GSM8K reference solution after its context (few-shot exemplars +
    question) read back from each cache: ``exp`` of the mean NLL over all solution tokens, plus ``tokens``."""
    nll = {n: 0.0 for n in names}
    count = 0
    makers = caches.makers(names)
    for it in tqdm(items, desc="perplexity", unit="problem"):
        ctx = tok(context_prefix + f"Question: {it['question']}\nAnswer:", return_tensors="pt").input_ids
        tgt = tok(" " + it["answer"], return_tensors="pt", add_special_tokens=False).input_ids
        count += tgt.shape[1]
        for n, (v, _) in nll_through_caches(model, ctx, tgt, makers).items():
            nll[n] += v
    return {n: math.exp(v / count) for n, v in nll.items()} | {"tokens": count}


def long_perplexity(model, tok, math500: Path, caches: Caches, names, ctx_len: int, tgt_len: int,
                    windows: int) -> dict:
    """Perplexity of ``tgt_len`` tokens after ``ctx_len`` tokens of MATH-500 text read from each cache,
    over ``windows`` texts (MATH-500 rows 0, 50, 100, ...)."""
    nll = {n: 0.0 for n in names}
    count = 0
    makers = caches.makers(names)
    for w in tqdm(range(windows), desc="long-context perplexity", unit="text"):
        text = long_context_text(math500, tok, ctx_len + tgt_len + 16, start=50 * w)
        ids = tok(text, return_tensors="pt").input_ids[:, :ctx_len + tgt_len]
        for n, (v, _) in nll_through_caches(model, ids[:, :ctx_len], ids[:, ctx_len:], makers).items():
            nll[n] += v
        count += tgt_len
    return {n: math.exp(v / count) for n, v in nll.items()} | {"tokens": count, "ctx_len": ctx_len, "windows": windows}


def arm_footprints(model, kv, caches: Caches, bytes_len: int) -> dict:
    """Per arm: the pairs its descriptors keep and the bytes it holds per token, after writing ``kv`` (a
    short prefill of whole groups, :func:`prefill_kv`) into it."""
    out = {}
    for arm in ARMS:
        probe = fill_cache(caches.arm(arm), kv)
        pr, nb = probe.outlier_pairs(), probe.nbytes()
        out[arm] = {"pairs": pr["k"] + pr["v"], "pairs_k": pr["k"], "pairs_v": pr["v"], "possible": pr["possible"],
                    "pairs_frac": (pr["k"] + pr["v"]) / pr["possible"] if pr["possible"] else 0.0,
                    "bytes": nb, "bytes_per_token": nb["total"] / bytes_len}
    return out


def arms_section(model, tok, test: list[dict], prefix: str, math500: Path, caches: Caches, cfg: dict,
                 baselines: list[str]) -> dict:
    """``{"arms": ...}`` and, when ``baselines`` is not empty, ``{"perplexity": ...}`` for the baselines and
    the headline cache from the same pass (the same prefill per problem)."""
    per_arm = arm_footprints(model, prefill_kv(model, bytes_ids(tok, cfg["bytes_len"], math500)), caches,
                             cfg["bytes_len"])
    ppl = perplexity(model, tok, test[:cfg["ppl_n"]], prefix, caches, ["bf16", *ARMS, *baselines])
    out = {}
    if baselines:
        out["perplexity"] = {n: ppl[n] for n in ["bf16", *baselines, "tokens"]} | {"inquant": ppl[DEFAULT_ARM]}
    out["arms"] = {
        "per_arm": per_arm, "bf16_bytes_per_token": bf16_bytes_per_token(model.config),
        "ppl": {n: ppl[n] for n in ["bf16", *ARMS, "tokens"]},
        "long_ppl": long_perplexity(model, tok, math500, caches, ["bf16", *ARMS], cfg["long_ctx"], cfg["long_tgt"],
                                    cfg["long_windows"]),
    }
    return out


def capacity_section(model, tok, math500: Path, caches: Caches, bytes_len: int, seq_len: int, gib: float) -> dict:
    """Sequences of ``seq_len`` tokens that fit ``gib`` GiB of KV cache, per cache."""
    kv = prefill_kv(model, bytes_ids(tok, bytes_len, math500))
    bpt, window = {"bf16": float(bf16_bytes_per_token(model.config))}, {"bf16": 0}
    for name in ["inquant", "inquant/per-channel/score", "kivi", "outlier-buffer"]:
        b = bytes_per_token(model, lambda name=name: caches.make(name), kv=kv)
        bpt[name], window[name] = b["held"], b["window_bytes"]
    budget = int(gib * 2**30)
    return {"seq_len": seq_len, "budget_gib": gib, "bytes_per_token": bpt, "window_bytes": window,
            "sequences": {n: capacity(b, budget, seq_len, window[n]) for n, b in bpt.items()}}


@torch.inference_mode()
def quant_speed(model, tok, text: str, length: int, caches: Caches, reps: int) -> dict:
    """Quantize + dequantize time per token (us, all layers, K+V, best of ``reps`` after a warm-up round) of
    the keys/values of a prefill, each layer quantized fresh (InQuant's saliency sampling and descriptor
    build included). With a calibration, also with outliers active: InQuant per channel (gates ``off`` and
    ``score``, descriptors built before timing, as a server holds them) vs the outlier buffer given the same
    fraction of entries as outliers (``outlier_frac``)."""
    group_size, cal = caches.group_size, caches.calibration
    ids = tok(text, return_tensors="pt").input_ids[:, :length]
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref, use_cache=True)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in ref.layers]
    T = kv[0][0].shape[-2]
    outlier_frac: dict[str, float] = {}
    makers = {"inquant": lambda i: InQuantLayer(group_size, backend="torch"),
              "kivi": lambda i: KIVILayer(group_size),
              "outlier-buffer": lambda i: OutlierBufferLayer(group_size)}
    if cal is not None:
        D = kv[0][0].shape[-1]
        n_out = 4
        for gate in ("off", "score"):
            descs = [(cal.descriptor(i, "k", n_out, 8, gate, "per-channel", group_size),
                      cal.descriptor(i, "v", n_out, 8, gate, "per-channel", group_size)) for i in range(len(kv))]
            frac = sum(int(d.pairs_per_head.sum()) for pair in descs for d in pair) / (2 * len(kv) * kv[0][0].shape[1] * D)
            makers[f"inquant/per-channel/{gate}"] = (
                lambda i, gate=gate: InQuantLayer(group_size, n_out, backend="torch", gate=gate,
                                                  calibration=cal, layer_idx=i))
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
    return {n: 1e6 * t / T for n, t in best.items()} | {"outlier_frac": outlier_frac}


@torch.inference_mode()
def decode_speed(model, tok, prompts, names, caches: Caches, new_tokens: int) -> dict:
    """``generate`` tokens/s per cache (greedy, exactly ``new_tokens`` each, best of two).

    What bounds InQuant here (CPU, bundled model, batch 4): per layer and step the unquantized cache runs
    two ``cat``s, InQuant's per-token layer a few hundred small PyTorch ops (quantizing the new token with
    its outlier pairs, reading the store back), so its gap is a fixed per-step cost that a fused kernel,
    not the layout, would remove. ``keep_dequantized`` (see ``InQuantTokenLayer``) drops the read-back,
    not the quantize, and costs an unquantized cache's memory."""
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    tok.padding_side = side
    out = {}
    for name in names:
        kw = {}
        best = math.inf
        for _ in range(2):
            if name != "bf16":
                kw["past_key_values"] = caches.make(name)
            t0 = time.perf_counter()
            gen = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, **kw)
            best = min(best, time.perf_counter() - t0)
        n_new = (gen.shape[1] - enc.input_ids.shape[1]) * gen.shape[0]
        out[name] = n_new / best
    return out


def served_section(model, tok, test: list[dict], math500: Path, caches: Caches, cfg: dict) -> dict:
    """Served throughput at a fixed KV budget (what ``serve_bf16_rows`` bf16 sequences of prompt + new tokens
    hold): ``serve_n`` GSM8K chat requests of mixed lengths (1, 1/2, 3/4, 1/4 of ``serve_new``) arriving
    ``serve_gap`` s apart after the first ``serve_bf16_rows``, bf16 vs the cache ``llmkit serve --kv-cache
    inquant`` builds from the calibration; both continuously batched (late requests join running batches)."""
    n_req, n_new, bf16_rows = cfg["serve_n"], cfg["serve_new"], cfg["serve_bf16_rows"]
    prompts = chat_prompts(tok, test[:n_req])
    news = ([max(1, round(n_new * f)) for f in (1.0, 0.5, 0.75, 0.25)] * n_req)[:n_req]
    arrivals = arrival_offsets(n_req, cfg["serve_gap"], burst=bf16_rows)
    seq_len = max(len(tok(p, add_special_tokens=False).input_ids) for p in prompts) + n_new
    budget = bf16_rows * seq_len * bf16_bytes_per_token(model.config)
    inq = bytes_per_token(model, lambda: caches.make("inquant"),
                          kv=prefill_kv(model, bytes_ids(tok, cfg["bytes_len"], math500)))
    factory, msg = inquant_serving_factory(model, caches.calibration)
    print(msg)
    probe = factory(model)
    if (probe.layout, probe.gate) != tuple(DEFAULT_ARM.split("/")[1:]) or not probe.rows_mergeable:
        raise RuntimeError(f"the serving cache is {probe.layout}/{probe.gate}, not {DEFAULT_ARM} (continuously batched)")
    rows = {"bf16": bf16_rows, "inquant": capacity(inq["held"], budget, seq_len, inq["window_bytes"])}
    served = {name: served_throughput(model, tok, prompts, news, rows[name], None if name == "bf16" else factory,
                                      arrivals=arrivals) for name in ("bf16", "inquant")}
    same = sum(a == b for a, b in zip(served["bf16"]["texts"], served["inquant"]["texts"]))
    return {"requests": n_req, "new_tokens": n_new, "new_tokens_each": news, "arrivals_s": arrivals,
            "seq_len": seq_len, "budget_bytes": budget, "rows": rows, "results": served,
            "same_answers": same, "serving_cache": msg}


def accuracy(model, tok, items, names, caches: Caches, max_new_tokens, batch_size, start: int = 0,
             budget_s: float | None = None, save=None, resume: dict | None = None) -> dict:
    """Greedy GSM8K accuracy per cache (zero-shot chat prompt, last number of the completion vs the gold
    answer), batch by batch: every name runs on a batch before the next batch starts, so a run stopped by
    ``budget_s`` (seconds; a batch is not started when the slowest batch so far would overrun it) still
    compares all names on the same problems. ``save(partial_result)`` is called after each batch;
    ``resume`` (such a partial result) continues after its last batch. Per-problem correctness is kept under
    ``ok`` (problem ``start + i``) so parts can be merged."""
    from llmkit.engines.hf import HFEngine
    from llmkit.generation import GenerationParams

    prompts = chat_prompts(tok, items)
    gold = [it["answer"].split("####")[-1].strip().replace(",", "") for it in items]
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    engines = {name: HFEngine(model, tok, batch_size=batch_size, cache_factory=caches.engine_factory(name))
               for name in names}
    out = {"start": start, "ok": {n: [] for n in names}, "seconds": {n: 0.0 for n in names}}
    if resume is not None:
        if resume.get("start") != start or set(resume.get("ok", {})) != set(names):
            raise ValueError(f"cannot resume GSM8K problems from {start} for {names} with a part for "
                             f"{sorted(resume.get('ok', {}))} from {resume.get('start')}")
        out["ok"] = {n: list(resume["ok"][n]) for n in names}
        out["seconds"] = {n: float(resume["seconds"][n]) for n in names}
    first = len(out["ok"][names[0]]) if names else 0
    t_start, slowest = time.perf_counter(), 0.0
    for b in tqdm(range(first, len(items), batch_size), desc="gsm8k batches"):
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
            raise ValueError(f"gsm8k parts are not consecutive: expected a part starting at {nxt}, got {p['start']}")
        for n in names:
            merged["ok"][n] += p["ok"][n]
            merged["seconds"][n] += p["seconds"][n]
        nxt = p["start"] + p["n"]
    return summarize_accuracy(merged)


# ------------------------------------------------------------------------------ figures


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


def plot_results(res: dict, path: str | Path) -> Path:
    """PNG of a ``bench/kv_cache.py`` result: perplexity ratio vs bf16 per InQuant arm (GSM8K
    solutions and long context) beside the baselines, and capacity / served throughput vs bf16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = res.get("arms")
    if not arms:
        raise ValueError("the result has no 'arms' section to plot")
    pb, lb = arms["ppl"]["bf16"], arms["long_ppl"]["bf16"]
    names = list(arms["per_arm"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [arms["ppl"][n] / pb - 1 for n in names], 0.4, label="GSM8K solutions")
    ax.bar([i + 0.2 for i in x], [arms["long_ppl"][n] / lb - 1 for n in names], 0.4, label="long context")
    base = {n: v / res["perplexity"]["bf16"] - 1 for n, v in res.get("perplexity", {}).items()
            if n not in ("bf16", "tokens", "inquant")}
    for j, (n, v) in enumerate(base.items()):
        ax.axhline(v, ls="--", lw=0.9, color=f"C{j + 2}", label=f"{n} (GSM8K)")
    labels = [f"{n.removeprefix('inquant/')}\n{arms['per_arm'][n]['pairs']}/{arms['per_arm'][n]['possible']} pairs"
              for n in names]
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("perplexity excess vs bf16 cache")
    ax.set_title("InQuant arms: layout / gate (pairs kept)")
    ax.legend(fontsize=7)
    ax = axes[1]
    bars = {}
    if "capacity" in res:
        seqs = res["capacity"]["sequences"]
        bars["capacity"] = seqs["inquant"] / seqs["bf16"]
    if "served" in res:
        r = res["served"]["results"]
        bars["served tok/s"] = r["inquant"]["tokens_per_s"] / r["bf16"]["tokens_per_s"]
    ax.bar(list(bars), list(bars.values()), color="tab:green")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("InQuant / bf16")
    ax.set_title("At a fixed KV budget")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def quiet_report(res: dict) -> dict:
    """:func:`report`'s figures without its lines."""
    with contextlib.redirect_stdout(io.StringIO()):
        return report(res)


def write_plot(res: dict, out: Path) -> None:
    """``<out>.png`` beside a result that has the InQuant arms."""
    if "arms" in res:
        print(f"plot written to {plot_results(res, Path(out).with_suffix('.png'))}")


# ------------------------------------------------------------------------------ a run, its parts, their merge

# the bench's flag defaults, and those that depend on --quick: (quick, full)
DEFAULTS = {"group_size": 128, "shots": 3, "acc_batch": 16, "compress_len": 512, "long_ctx": 2048, "long_tgt": 256,
            "cap_len": 2048, "bytes_len": 512, "cap_gib": 8.0, "serve_gap": 1.0, "serve_bf16_rows": 2}
QUICK_DEFAULTS = {"ppl_n": (8, 40), "acc_n": (6, 32), "acc_names": ("bf16,inquant,kivi", "bf16,inquant"),
                  "max_new_tokens": (96, 256), "calib_texts": (4, 16), "long_windows": (1, 4), "serve_n": (12, 16),
                  "serve_new": (32, 64)}
# the settings that shape a result: parts made with other settings are neither resumed nor merged
SETTINGS = ("model", "quick", "group_size", "shots", "ppl_n", "acc_n", "acc_names", "acc_batch", "max_new_tokens",
            "compress_len", "calib_texts", "long_ctx", "long_tgt", "long_windows", "cap_len", "bytes_len", "cap_gib",
            "serve_n", "serve_new", "serve_gap", "serve_bf16_rows")
# section (a --skip name) -> the results key it fills, in the order they run
SECTIONS = {"arms": "arms", "capacity": "capacity", "speed": "quant_us_per_token", "serve": "served",
            "compression": "compression", "ppl": "perplexity", "decode": "decode_tokens_per_s", "acc": "gsm8k"}
PART_SKIPS = {"all": set(), "core": {"acc"}, "acc": set(SECTIONS) - {"acc"}}


def settings(opts: dict) -> dict:
    """The run's settings from the bench's options (``vars(args)``), defaults filled in."""
    cfg = {k: opts.get(k, DEFAULTS.get(k)) for k in SETTINGS} | {"quick": bool(opts.get("quick"))}
    for k, (quick, full) in QUICK_DEFAULTS.items():
        cfg[k] = cfg[k] or (quick if cfg["quick"] else full)
    if isinstance(cfg["acc_names"], str):
        cfg["acc_names"] = cfg["acc_names"].split(",")
    return cfg


def part_name(part: str, acc_start: int = 0) -> str:
    if part not in PART_SKIPS:
        raise ValueError(f"unknown part {part!r}: one of {sorted(PART_SKIPS)}")
    return f"acc_{acc_start:04d}" if part == "acc" else part


def run(model, tok, cfg: dict, *, gsm8k: Path, math500: Path, store: ResultStore, part: str = "all",
        acc_start: int = 0, budget_s: float | None = None, skip=(), recalibrate: bool = False,
        out: Path | None = None) -> dict:
    """Run the sections of ``part`` (``all``, ``core``: all but GSM8K accuracy, ``acc``: accuracy from
    ``acc_start``) not in ``skip``, print one line per figure, and return the result with its ``figures``.

    After each section (and GSM8K batch) the result so far is saved, marked partial, as part
    ``part_name(part, acc_start)`` of ``store`` (and written to ``out`` when given); a rerun with the same
    settings resumes a partial part after its last saved section. ``gsm8k`` is a folder with
    ``train.jsonl`` and ``test.jsonl``; ``math500`` MATH-500's ``test.jsonl``.
    """
    name = part_name(part, acc_start)
    skip = set(skip) | PART_SKIPS[part]
    q = cfg["quick"]
    torch.manual_seed(0)
    train, test = read_jsonl(Path(gsm8k) / "train.jsonl"), read_jsonl(Path(gsm8k) / "test.jsonl")
    prefix, long_text = fewshot_context(train, cfg["shots"]), fewshot_context(train, 12)
    res = {"model": cfg["model"] or "smollm2-135m-instruct", "quick": q, "group_size": cfg["group_size"],
           "dtype": str(model.dtype), "torch_threads": torch.get_num_threads(), "compress_len": cfg["compress_len"],
           "shots": cfg["shots"], "ppl_n": cfg["ppl_n"], "max_new_tokens": cfg["max_new_tokens"],
           "bytes_len": cfg["bytes_len"]}
    saved = store.load(name)
    if saved is not None and saved.get("partial"):
        res = {k: v for k, v in saved.items() if k not in ("partial", "figures")}
        done = [k for k in SECTIONS.values() if k in res]
        print(f"resuming {store.path(name)}: {', '.join(done) or 'no section'} saved", flush=True)
    cal, info = calibrate_or_reuse(model, tok, train, cfg["calib_texts"], recalibrate)
    res.setdefault("calibration", info)
    print(f"InQuant calibration: {info['texts']} GSM8K train texts, {info['tokens']} tokens "
          f"({'reused' if info['reused'] else 'made'}: {info['path']})")
    caches = Caches(model, cfg["group_size"], cal)

    def checkpoint(extra: dict | None = None):
        body = res | (extra or {})
        body |= {"figures": quiet_report(body), "partial": True}
        store.save(name, body)
        if out is not None:
            write_json(Path(out), body)

    quanto = ["hf-quanto"] if quanto_available() and "quanto" not in skip else []

    def baseline_ppl():
        if not quanto:
            print("transformers QuantizedCache: skipped (optimum-quanto is not installed, or --skip quanto)")
        return {"perplexity": perplexity(model, tok, test[:cfg["ppl_n"]], prefix, caches, ["bf16", *METHODS, *quanto])}

    steps = {
        "arms": lambda: arms_section(model, tok, test, prefix, math500, caches, cfg,
                                     [*METHODS[1:], *quanto] if "ppl" not in skip else []),
        "capacity": lambda: {"capacity": capacity_section(model, tok, math500, caches, cfg["bytes_len"],
                                                          cfg["cap_len"], cfg["cap_gib"])},
        "speed": lambda: {"quant_us_per_token": quant_speed(model, tok, long_text, cfg["compress_len"], caches,
                                                            reps=2 if q else 5)},
        "serve": lambda: {"served": served_section(model, tok, test, math500, caches, cfg)},
        "compression": lambda: {"compression": compression(model, tok, long_text, cfg["compress_len"], caches),
                                "inquant_outlier_pairs": outlier_pairs(model, tok, long_text, cfg["compress_len"],
                                                                       caches)},
        "ppl": baseline_ppl,
        # ~150-200 token prompts: the packed store is in use
        "decode": lambda: {"decode_tokens_per_s": decode_speed(model, tok, [prefix[:600 + 50 * i] for i in range(4)],
                                                               ["bf16", *METHODS], caches, 48 if q else 128)},
    }
    for sec, make in steps.items():
        if sec not in skip and SECTIONS[sec] not in res:
            res.update(make())
            checkpoint()
    if "acc" not in skip:
        items = test[acc_start:acc_start + cfg["acc_n"]]
        res["gsm8k"] = accuracy(model, tok, items, cfg["acc_names"], caches, cfg["max_new_tokens"], cfg["acc_batch"],
                                start=acc_start, budget_s=budget_s, save=lambda p: checkpoint({"gsm8k": p}),
                                resume=res.get("gsm8k"))
    res["figures"] = report(res)
    store.save(name, res)
    if out is not None:
        write_json(Path(out), res)
    return res


def merge_parts(store: ResultStore) -> dict:
    """One result from the store's ``core`` part and its ``acc_*`` parts (consecutive GSM8K problem ranges),
    those saved with the store's settings; ``parts`` names them."""
    parts = {n: v for n, v in store.merge().items() if n == "core" or n.startswith("acc_")}
    accs = [parts[n] for n in sorted(parts) if n.startswith("acc_")]
    if "core" in parts:
        res = dict(parts["core"])
    elif accs:  # accuracy only: the core part has not been run
        res = {k: v for k, v in accs[0].items() if k != "gsm8k"}
        print(f"{store.path('core')} is missing: compression, perplexity, speed and decode not included")
    else:
        raise FileNotFoundError(f"nothing to merge in {store.root} for these settings")
    if accs:
        res["gsm8k"] = merge_accuracy([a["gsm8k"] for a in accs])
        res["max_new_tokens"] = accs[0]["max_new_tokens"]
    res["parts"] = [f"{n}.json" for n in sorted(parts)]
    return res
