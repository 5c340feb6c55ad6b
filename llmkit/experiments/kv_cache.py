"""Measuring KV caches: teacher-forced perplexity through a cache, long-context text, capacity.

Used by ``bench/kv_cache.py`` (and tested on tiny models):

- :func:`nll_through_caches`: a context is prefilled once (unquantized), its per-layer keys and
  values are written into each cache with ``cache.update`` (the calls the model's own prefill
  makes) and ``flush()``-ed, so every context token is read back from the cache's store; the
  target is then scored in one forward pass reading that past. Returns summed NLL and token count.
- :func:`long_context_text`: a text of at least ``min_tokens`` tokens built by concatenating
  MATH-500 problems and reference solutions (another domain than the GSM8K calibration texts).
- :func:`bytes_per_token` and :func:`capacity`: how many concurrent sequences of a given length
  fit a fixed KV budget, from the bytes a cache actually holds per token after a prefill plus,
  per sequence, a full-precision window at its fullest (caches that have one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch


@torch.inference_mode()
def nll_through_caches(model, ctx_ids: torch.Tensor, tgt_ids: torch.Tensor,
                       makers: dict[str, Callable | None]) -> dict[str, tuple[float, int]]:
    """Summed NLL of ``tgt_ids [1, n]`` after ``ctx_ids [1, m]`` read back from each cache
    (``makers[name]() -> Cache``; ``None`` = transformers' unquantized ``DynamicCache``)."""
    from transformers import DynamicCache

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
    from transformers import DynamicCache

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
    import threading
    import time

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
