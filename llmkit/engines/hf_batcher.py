"""Continuously batched streaming generation over a transformers model (the serving path of ``HFEngine``).

Requests wait in a queue. The engine thread keeps one running batch and, before every decode step, admits
whatever arrived meanwhile (up to ``max_batch_size`` rows in all): the newcomers are prefilled together, their
first token is sampled, and their ``DynamicCache`` rows are merged into the running cache (both sides
left-padded with masked zeros to the same length), so they decode with the rows already running from the next
step on. Rows that finish or whose client leaves are dropped from the batch and from the cache at once, and
leading cache columns that no remaining row attends to are cut off. The default cache's layers keep spare
columns (``new_cache``): a decode step writes its column in place, and on CPU attention reads grouped
key/value heads without repeating them (``use_gqa_sdpa``, set by ``HFEngine``; bitwise the same logits).

The batch runs its own decode loop rather than ``model.generate``: every row keeps its own sampling parameters
(temperature, top_p, seed through a per-row ``torch.Generator``, max_tokens, stop strings) and text streams
out after every step. Positions come from the attention mask (as in ``generate``); prefill computes the logits
of the last position only.

With ``engine.cache_factory`` set (e.g. InQuant), the KV cache is the factory's. A cache whose
``rows_mergeable`` is true (InQuant with per-token groups and a calibration: its layers implement ``cut_left``
and ``merge_rows``) is batched continuously like the default cache. Any other factory cache need not support
removing or merging rows: then a batch runs to its end with finished rows kept (masked out of the output), and
new requests wait for the next batch (static batching).

Per row the sampler also applies the OpenAI/vLLM extras: ``repetition_penalty`` (HF's rule, over prompt and
generated tokens), ``presence_penalty`` and ``frequency_penalty`` (OpenAI's rule, over generated tokens),
``top_k``, ``min_p``, and a grammar (``StreamRequest.grammar``, an xgrammar ``CompiledGrammar`` for
``response_format`` / forced tool calls): its token mask is applied before sampling, so the answer is valid by
construction. ``params.logprobs`` and ``params.prompt_logprobs`` report the model's own (raw, unpenalized)
log-probabilities, as vLLM does by default. With LoRA adapters loaded (``HFEngine.load_adapters``), every
forward passes ``adapter_names`` per row (PEFT's mixed-adapter batches), so requests for different adapters
and the base model share one batch.

vLLM's own request extras are honoured per row with vLLM's meanings: ``ignore_eos`` (EOS is an ordinary
token), ``min_tokens`` (EOS and ``stop_token_ids`` get no probability, and stop strings are not looked for,
until that many tokens exist), ``stop_token_ids`` (end like EOS), ``include_stop_str_in_output``,
``skip_special_tokens`` and ``spaces_between_special_tokens`` (``TextStream``'s decoding).

``greedy_generate`` is the same decode loop without streaming, used by ``HFEngine.generate`` for greedy
requests (evals): it gives ``generate()``'s text, stops each row at EOS, ``max_new_tokens`` or (once it is
certain) a stop string, and drops finished rows instead of carrying them to the end of the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from llmkit.engines.stream import StreamEvent, StreamLoop, StreamRequest, TextStream


def _left_padded(prompts: list[list[int]], pad_id: int, device):
    """``input_ids``, ``attention_mask`` and ``position_ids`` for left-padded prompts."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p):] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    return input_ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def _last_logits_only(model) -> dict:
    """``logits_to_keep=1`` where the model takes it: prefill needs the last position's logits only."""
    import inspect

    try:
        return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    except (TypeError, ValueError):
        return {}


GQA_SDPA = "llmkit_sdpa_gqa"


def _sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, except that on CPU grouped key/value heads are read in place.

    With a mask (left padding), transformers repeats every key/value head for its query heads
    before SDPA (a copy of the whole cache per layer and step: a tenth of a decode step at batch 8
    on the bundled model, and triple the attention's time). PyTorch's CPU kernel takes the mask
    with ``enable_gqa`` and gives bitwise the same output (tested), so on CPU it gets the heads
    as they are; elsewhere (CUDA falls back to its math kernel for GQA with a mask) and for
    anything unusual (position bias, a paged cache, attention weights) transformers' own path runs.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type != "cpu" or attention_mask is None or key.shape[1] == query.shape[1]
            or query.shape[1] % key.shape[1] or key.shape[-1] != value.shape[-1]
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model) -> None:
    """Point a model that runs transformers' ``sdpa`` at ``_sdpa_gqa`` (same masks, same outputs)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    if GQA_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(GQA_SDPA, _sdpa_gqa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = GQA_SDPA


def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys/values are views into buffers with spare columns.

        ``DynamicLayer.update`` concatenates, copying the whole cache at every decode step (a
        fifth of a decode step's time at batch 8 and a 130-token context on the bundled model,
        growing with the context). Here a step writes its column in place; the buffers are
        reallocated (doubling) only when full, or when the batcher has replaced ``keys``
        (rows dropped or merged, leading columns cut), which it does by assigning new tensors.
        """

        _kbuf = _vbuf = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, add = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
            buf = self._kbuf
            if (buf is None or n + add > buf.shape[-2] or buf.shape[0] != key_states.shape[0]
                    or (n and (self.keys.data_ptr() != buf.data_ptr() or self.values.data_ptr() != self._vbuf.data_ptr()))):
                cap = max(64, 2 * (n + add))
                shape = (*key_states.shape[:2], cap, key_states.shape[-1])
                self._kbuf = key_states.new_empty(shape)
                self._vbuf = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
                if n:
                    self._kbuf[:, :, :n] = self.keys
                    self._vbuf[:, :, :n] = self.values
            self._kbuf[:, :, n:n + add] = key_states
            self._vbuf[:, :, n:n + add] = value_states
            self.keys, self.values = self._kbuf[:, :, :n + add], self._vbuf[:, :, :n + add]
            return self.keys, self.values

        def reset(self) -> None:
            self._kbuf = self._vbuf = None
            super().reset()

    return GrowingLayer


_GROWING = None


def new_cache(model):
    """The batcher's default KV cache: a ``DynamicCache`` whose full-attention layers grow in place."""
    global _GROWING
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if _GROWING is None:
        _GROWING = _growing_layer_class()
    cache = DynamicCache(config=model.config)
    cache.layers = [_GROWING() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _plain_dynamic(cache) -> bool:
    """True for a ``DynamicCache`` made only of full-attention ``DynamicLayer``s (rows can be merged/cut)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return type(cache) is DynamicCache and all(type(layer) in (DynamicLayer, _GROWING) for layer in cache.layers)


def _mergeable(cache) -> bool:
    """Rows can be removed, cut and merged: the default cache, or a cache that says so."""
    return _plain_dynamic(cache) or bool(getattr(cache, "rows_mergeable", False))


def _cache_tensors(cache):
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.numel():
            yield layer


def _trim_left(cache, attn: torch.Tensor) -> torch.Tensor:
    """Cut leading columns that no row attends to (from the mask and every cache layer)."""
    cols = attn.any(0)
    first = int(cols.to(torch.int8).argmax()) if bool(cols.any()) else 0
    if first > 0:
        for layer in cache.layers:
            if hasattr(layer, "cut_left"):
                layer.cut_left(first)
        for layer in _cache_tensors(cache):
            layer.keys = layer.keys[:, :, first:]
            layer.values = layer.values[:, :, first:]
        attn = attn[:, first:]
    return attn


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], pad_id: int,
                    stop_reached=None) -> list[tuple[list[int], bool]]:
    """Greedy decoding of one left-padded batch; per row ``(new token ids without EOS, hit_eos)``.

    ``stop_reached(ids) -> bool`` ends a row early (the caller cuts its text). Finished rows are
    dropped from the batch and the cache; the padding of the remaining rows is left as it is, so
    every row sees the same inputs as in ``model.generate`` on the same batch.
    """
    dev = model.device
    input_ids, attn, positions = _left_padded(prompts, pad_id, dev)
    cache = new_cache(model)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                use_cache=True, **_last_logits_only(model))
    next_pos = positions[:, -1] + 1
    ids: list[list[int]] = [[] for _ in prompts]
    hit_eos = [False] * len(prompts)
    active = list(range(len(prompts)))  # tensor row -> prompt index
    while True:
        tokens = out.logits[:, -1, :].argmax(-1)
        keep = []
        for row, (i, t) in enumerate(zip(active, tokens.tolist())):
            if t in eos:
                hit_eos[i] = True
                continue
            ids[i].append(t)
            if len(ids[i]) >= max_new_tokens or (stop_reached is not None and stop_reached(ids[i])):
                continue
            keep.append(row)
        if not keep:
            return list(zip(ids, hit_eos))
        if len(keep) < len(active):
            idx = torch.tensor(keep, dtype=torch.long, device=dev)
            cache.batch_select_indices(idx)
            attn, next_pos, tokens = attn[idx], next_pos[idx], tokens[idx]
            active = [active[row] for row in keep]
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1


@dataclass
class _Row:
    req: StreamRequest
    stream: TextStream
    gen: torch.Generator | None
    count: int = 0
    done: bool = False
    matcher: object | None = None  # xgrammar GrammarMatcher when the output is constrained
    lps: list = field(default_factory=list)  # logprob entries not yet sent
    plps: list | None = None  # prompt logprobs, sent with the first event


@dataclass
class _Batch:
    """A running batch: rows aligned with the tensors; ``attn`` has one column per cached position."""

    rows: list[_Row]
    cache: object
    attn: torch.Tensor
    next_pos: torch.Tensor  # position of each row's pending token
    pending: torch.Tensor | None = None  # sampled, not yet fed tokens
    droppable: bool = True  # plain DynamicCache: rows can be removed and merged
    extra: dict = field(default_factory=dict)


class HFBatcher(StreamLoop):
    def __init__(self, engine, max_batch_size: int = 32, coalesce_s: float = 0.005):
        super().__init__(name="llmkit-hf-batcher")
        from llmkit.generation import _eos_ids

        self.engine = engine
        self.max_batch_size = max_batch_size
        self.coalesce_s = coalesce_s
        self.eos = _eos_ids(engine.model, engine.tokenizer)
        tok = engine.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(self.eos), 0)
        self.batches = 0  # prefill groups run (tests check that requests share them)
        self.joined = 0  # requests admitted into an already running batch
        self.max_batch_seen = 0

    # -- loop ---------------------------------------------------------------------------------
    def _loop(self):
        batch: _Batch | None = None
        while True:
            new: list[StreamRequest] = []
            if batch is None:
                if self._stopping:
                    break
                new = self._take(block=True, limit=self.max_batch_size)
                if not new:
                    continue
                if len(new) < self.max_batch_size and self.coalesce_s:
                    time.sleep(self.coalesce_s)  # let requests sent at the same moment share the prefill
                    new += self._take(block=False, limit=self.max_batch_size - len(new))
            elif not self._stopping and batch.droppable and len(batch.rows) < self.max_batch_size:
                # on stop the running rows finish; what is still queued gets an error (StreamLoop)
                new = self._take(block=False, limit=self.max_batch_size - len(batch.rows))
            added: list[_Row] = []
            try:
                if new:
                    self.batches += 1
                    fresh = self._prefill(new, added)
                    if batch is not None and fresh is not None:
                        self.joined += len(fresh.rows)
                    batch = self._merge(batch, fresh)
                if batch is not None:
                    self.running = len(batch.rows)
                    self.max_batch_seen = max(self.max_batch_seen, sum(not r.done for r in batch.rows))
                    batch = self._step(batch)
            except Exception as e:  # noqa: BLE001 - a failing step must not take the server down
                live = (batch.rows if batch is not None else []) + added
                for row in live:
                    if not row.done:
                        row.done = True
                        row.req.on_event(StreamEvent(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                batch = None
            self.running = len(batch.rows) if batch is not None else 0

    # -- steps --------------------------------------------------------------------------------
    def _prefill(self, reqs: list[StreamRequest], added: list[_Row]) -> _Batch | None:
        model, tok = self.engine.model, self.engine.tokenizer
        dev = model.device
        rows = []
        for r in reqs:
            g = None
            if not r.params.greedy and r.params.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(int(r.params.seed))
            matcher = None
            if r.grammar is not None:
                import xgrammar as xgr

                matcher = xgr.GrammarMatcher(r.grammar)
            rows.append(_Row(r, TextStream.for_params(tok, r.params), g, matcher=matcher))
        added.extend(rows)
        input_ids, attn, positions = _left_padded([r.prompt_ids for r in reqs], self.pad_id, dev)
        cache = self.engine.cache_factory(model) if self.engine.cache_factory is not None else None
        if cache is None:
            cache = new_cache(model)
        want_prompt = any(r.params.prompt_logprobs is not None for r in reqs)
        with torch.inference_mode():
            out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                        use_cache=True, **({} if want_prompt else _last_logits_only(model)), **self._adapters(rows))
            if want_prompt:
                for i, row in enumerate(rows):
                    k = row.req.params.prompt_logprobs
                    if k is not None:
                        ids = row.req.prompt_ids
                        lp = out.logits[i, input_ids.shape[1] - len(ids):-1].float().log_softmax(-1)
                        row.plps = [(ids[0], None, [])] + [_entry(lp[j], t, k) for j, t in enumerate(ids[1:])]
        batch = _Batch(rows, cache, attn, positions[:, -1] + 1, droppable=_mergeable(cache))
        return self._advance(batch, out.logits[:, -1, :].float())

    def _adapters(self, rows) -> dict:
        """PEFT's per-row ``adapter_names`` when adapters are loaded (``__base__`` = no adapter)."""
        if not getattr(self.engine, "adapters", None):
            return {}
        return {"adapter_names": [r.req.adapter or "__base__" for r in rows]}

    def _step(self, batch: _Batch) -> _Batch | None:
        attn = torch.cat([batch.attn, batch.attn.new_ones((batch.attn.shape[0], 1))], dim=1)
        with torch.inference_mode():
            out = self.engine.model(input_ids=batch.pending[:, None], attention_mask=attn,
                                    position_ids=batch.next_pos[:, None], past_key_values=batch.cache, use_cache=True,
                                    **self._adapters(batch.rows))
        batch.attn, batch.next_pos = attn, batch.next_pos + 1
        return self._advance(batch, out.logits[:, -1, :].float())

    def _advance(self, batch: _Batch, logits: torch.Tensor) -> _Batch | None:
        """Sample one token per row, emit events, drop finished rows; ``None`` once no row runs."""
        tokens = self._sample(logits, batch.rows)
        for i, (row, t) in enumerate(zip(batch.rows, tokens.tolist())):
            if row.done:
                continue
            r = row.req
            if r.cancelled:
                self._end(row, "", "abort")
                continue
            if row.matcher is not None and not row.matcher.accept_token(t):
                self._end(row, row.stream.finish(), "error", f"the grammar rejected token {t}")
                continue
            p = r.params
            if (t in self.eos and not p.ignore_eos) or t in p.stop_token_ids:
                tail = ""
                if p.include_stop_str_in_output:  # the stop token is part of the answer (its text, if any)
                    tail = self._take_token(row, t, logits[i])
                self._end(row, tail + row.stream.finish(), "stop")
                continue
            delta = self._take_token(row, t, logits[i])
            if row.stream.stopped:
                self._end(row, delta, "stop")
            elif row.matcher is not None and row.matcher.is_terminated():
                self._end(row, delta + row.stream.finish(), "stop")
            elif row.count >= r.params.max_new_tokens:
                delta += row.stream.finish()
                self._end(row, delta, "stop" if row.stream.stopped else "length")
            elif delta:
                r.on_event(StreamEvent(text=delta, n_tokens=row.count, logprobs=self._take_lps(row),
                                       prompt_logprobs=self._take_plps(row)))
        keep = [i for i, row in enumerate(batch.rows) if not row.done]
        if not keep:
            return None
        batch.pending = tokens
        if batch.droppable and len(keep) < len(batch.rows):
            idx = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            batch.cache.batch_select_indices(idx)
            batch.attn, batch.next_pos, batch.pending = batch.attn[idx], batch.next_pos[idx], tokens[idx]
            batch.rows = [batch.rows[i] for i in keep]
            batch.attn = _trim_left(batch.cache, batch.attn)
        return batch

    @staticmethod
    def _take_token(row: _Row, t: int, logits: torch.Tensor) -> str:
        """Add one generated token to the row (count, logprobs, text); the text now safe to send."""
        if row.req.params.logprobs is not None:
            row.lps.append(_entry(logits.log_softmax(-1), t, row.req.params.logprobs))
        row.count += 1
        return row.stream.add(t)

    def _merge(self, a: _Batch | None, b: _Batch | None) -> _Batch | None:
        """One batch holding the rows of both (caches left-padded to the same length, then stacked)."""
        if a is None or b is None:
            return a if b is None else b
        width = max(a.attn.shape[1], b.attn.shape[1])
        for la, lb in zip(a.cache.layers, b.cache.layers):
            if hasattr(la, "merge_rows"):
                la.merge_rows(lb, width)
                continue
            la.keys = torch.cat([_pad_left(la.keys, width, 2), _pad_left(lb.keys, width, 2)], dim=0)
            la.values = torch.cat([_pad_left(la.values, width, 2), _pad_left(lb.values, width, 2)], dim=0)
        a.attn = torch.cat([_pad_left(a.attn, width, 1), _pad_left(b.attn, width, 1)], dim=0)
        a.next_pos = torch.cat([a.next_pos, b.next_pos])
        a.pending = torch.cat([a.pending, b.pending])
        a.rows = a.rows + b.rows
        return a

    @staticmethod
    def _take_lps(row: _Row):
        lps, row.lps = row.lps, []
        return lps or None

    @staticmethod
    def _take_plps(row: _Row):
        plps, row.plps = row.plps, None
        return plps

    def _end(self, row: _Row, text: str, reason: str, error: str | None = None):
        row.done = True
        row.req.on_event(StreamEvent(text=text, n_tokens=row.count, finish_reason=reason, error=error,
                                     logprobs=self._take_lps(row), prompt_logprobs=self._take_plps(row)))

    def _shape(self, scores: torch.Tensor, row: _Row) -> torch.Tensor:
        """Penalties and the grammar mask on one row's logits (a copy; the raw logits stay for logprobs)."""
        p = row.req.params
        scores = scores.clone()
        gen = row.stream.ids
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.req.prompt_ids) | set(gen)), dtype=torch.long, device=scores.device)
            seen = seen[seen < scores.shape[0]]
            sel = scores[seen]
            scores[seen] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and gen:
            counts = torch.bincount(torch.tensor(gen, device=scores.device), minlength=scores.shape[0])
            counts = counts[: scores.shape[0]].to(scores.dtype)
            scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
        if row.count < p.min_tokens:  # vLLM's min_tokens: nothing that ends the answer may come yet
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
            ids = torch.tensor(sorted(b for b in banned if b < scores.shape[0]), dtype=torch.long, device=scores.device)
            scores[ids] = float("-inf")
        if row.matcher is not None:
            import xgrammar as xgr

            mask = xgr.allocate_token_bitmask(1, scores.shape[0])
            row.matcher.fill_next_token_bitmask(mask)
            view = scores[None]
            xgr.apply_token_bitmask_inplace(view, mask.to(scores.device), vocab_size=scores.shape[0])
        return scores

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """One token per row: argmax for greedy rows, else a draw after temperature, top_k, min_p, top_p.

        Only the shaping (penalties, grammar, min_tokens) runs per row; the truncations run on all drawn
        rows at once, and rows without a seed share one uniform draw (inverse CDF, a seventh of
        ``torch.multinomial``'s time over a 49k vocabulary). Seeded rows draw with their own generator.
        """
        out = logits.argmax(-1)
        drawn, shaped_scores = [], {}
        for i, row in enumerate(rows):
            p = row.req.params
            if row.done:
                continue
            shaped = (row.matcher is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                      or p.presence_penalty != 0.0 or row.count < p.min_tokens)
            if p.greedy and not shaped:
                continue
            if shaped:
                scores = self._shape(logits[i], row)
                if p.greedy:
                    out[i] = scores.argmax()
                    continue
                shaped_scores[len(drawn)] = scores
            drawn.append(i)
        if not drawn:
            return out
        dev = logits.device
        ps = [rows[i].req.params for i in drawn]
        every = len(drawn) == logits.shape[0]  # the usual case: no row greedy, so no gather copy
        scores = logits if every else logits[torch.tensor(drawn, device=dev)]
        if shaped_scores:
            scores = scores.clone() if every else scores  # the raw logits stay for logprobs
            for j, s in shaped_scores.items():
                scores[j] = s
        scores = _truncate(scores, [p.temperature for p in ps], [p.top_k for p in ps], [p.min_p for p in ps],
                           [p.top_p for p in ps])
        free = [j for j, i in enumerate(drawn) if rows[i].gen is None]
        if free:
            cdf = (scores if len(free) == len(drawn) else scores[torch.tensor(free, device=dev)]).softmax(-1).cumsum(-1)
            u = torch.rand((len(free), 1), device=dev) * cdf[:, -1:]
            picks = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
            out[torch.tensor([drawn[j] for j in free], device=dev)] = picks
        for j, i in enumerate(drawn):
            if rows[i].gen is not None:
                out[i] = torch.multinomial(scores[j].softmax(-1), 1, generator=rows[i].gen)[0]
        return out


_TOP_P_PREFIXES = (256, 4096)  # top_p looks among this many best tokens first; a full sort only when they hold too little mass


def _truncate(scores: torch.Tensor, temperature, top_k, min_p, top_p) -> torch.Tensor:
    """Rows of logits divided by their temperature, with top_k, min_p and top_p (in that order) set to -inf.

    top_p keeps a token while the mass of the tokens before it is at most ``top_p`` (the top token always
    stays). A full sort of a 49k vocabulary costs a quarter of a decode step at batch 8, so the nucleus is
    first sought among the 256 best tokens (a peaked distribution), then the 4096 best (a flat one): once they
    hold more than ``top_p`` of the mass, every token after them is dropped anyway; only rows where even the
    4096 do not are sorted in full.
    """
    vocab = scores.shape[1]
    dev = scores.device
    scores = scores / torch.tensor(temperature, dtype=scores.dtype, device=dev)[:, None]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if any(ks):
        vals = scores.topk(max(ks), dim=-1).values
        kth = vals.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        kth = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, kth, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if any(m > 0.0 for m in min_p):
        probs = scores.softmax(-1)
        floor = torch.tensor(min_p, dtype=probs.dtype, device=dev)[:, None] * probs.max(-1, keepdim=True).values
        scores = scores.masked_fill(probs < floor, float("-inf"))
    nucleus = [j for j, tp in enumerate(top_p) if tp < 1.0]
    if nucleus:
        todo = torch.tensor(nucleus, device=dev)
        limit = torch.tensor(top_p, dtype=scores.dtype, device=dev)[:, None]
        for k in (*_TOP_P_PREFIXES, vocab):  # the last: the whole vocabulary, sorted
            k = min(k, vocab)
            sub, tp = scores[todo], limit[todo]
            vals, order = sub.topk(k, dim=-1)
            probs = (vals - sub.logsumexp(-1, keepdim=True)).exp()
            cum = probs.cumsum(-1)
            keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, order, (cum - probs) <= tp)
            found = (cum[:, -1:] > tp)[:, 0] | (k == vocab)  # past the prefix, every token is dropped
            scores[todo[found]] = sub[found].masked_fill(~keep[found], float("-inf"))
            todo = todo[~found]
            if not len(todo):
                break
    return scores


def _entry(logprobs: torch.Tensor, token: int, k: int) -> tuple:
    """``(token, logprob, [(id, logprob) of the k most likely])`` from one position's log-softmax."""
    top = []
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[0]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return (int(token), float(logprobs[token]), top)
