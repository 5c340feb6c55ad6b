"""Batched streaming generation over a transformers model (the serving path of ``HFEngine``).

Requests wait in a queue; the engine thread takes everything pending (up to
``max_batch_size``) as one batch, and requests arriving while it runs join
the next batch. A batch runs its own decode loop rather than
``model.generate``, for three reasons: every row keeps its own sampling
parameters (temperature, top_p, seed through a per-row ``torch.Generator``,
max_tokens, stop strings), text streams out after every step, and rows that
finish or whose client leaves are dropped from the batch (and from the KV
cache) at once instead of riding along until the longest row ends.

Prompts are left-padded, positions come from the attention mask (as
``generate`` does), and the KV cache is ``engine.cache_factory(model)`` when
one is set (e.g. InQuant) or a ``DynamicCache``. Custom caches need not
support removing rows, so with one, finished rows stay in the batch and are
ignored.
"""

from __future__ import annotations

import time

import torch

from llmkit.engines.stream import StreamEvent, StreamLoop, StreamRequest, TextStream


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
        self.batches = 0  # number of batches run (tests check that requests share batches)
        self.max_batch_seen = 0

    def _loop(self):
        while not self._stopping:
            batch = self._take(block=True, limit=self.max_batch_size)
            if not batch:
                continue
            if len(batch) < self.max_batch_size and self.coalesce_s:
                time.sleep(self.coalesce_s)  # let requests sent at the same moment share the batch
                batch += self._take(block=False, limit=self.max_batch_size - len(batch))
            self.running = len(batch)
            self.batches += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            finished: set[str] = set()
            try:
                self._run_batch(batch, finished)
            except Exception as e:  # a failing batch must not take the server down
                for r in batch:
                    if r.id not in finished:
                        r.on_event(StreamEvent(finish_reason="error", error=f"{type(e).__name__}: {e}"))
            finally:
                self.running = 0

    def _sample(self, logits: torch.Tensor, reqs: list[StreamRequest], gens) -> list[int]:
        out = logits.argmax(-1)
        for row, r in enumerate(reqs):
            p = r.params
            if p.greedy:
                continue
            scores = logits[row] / p.temperature
            if p.top_p < 1.0:
                sorted_scores, order = scores.sort(descending=True)
                probs = sorted_scores.softmax(-1)
                # drop tokens once the mass before them already exceeds top_p (the top token always stays)
                sorted_scores[(probs.cumsum(-1) - probs) > p.top_p] = float("-inf")
                scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
            out[row] = torch.multinomial(scores.softmax(-1), 1, generator=gens[row])[0]
        return out.tolist()

    @torch.inference_mode()
    def _run_batch(self, reqs: list[StreamRequest], finished: set[str]):
        from transformers import DynamicCache

        model, tok = self.engine.model, self.engine.tokenizer
        dev = model.device
        width = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attn[i, width - len(r.prompt_ids):] = 1
        input_ids, attn = input_ids.to(dev), attn.to(dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)

        cache = self.engine.cache_factory(model) if self.engine.cache_factory is not None else None
        can_drop_rows = cache is None
        if cache is None:
            cache = DynamicCache(config=model.config)

        streams = [TextStream(tok, r.params.stop) for r in reqs]
        gens = []
        for r in reqs:
            g = None
            if not r.params.greedy and r.params.seed is not None:
                g = torch.Generator(device=dev)
                g.manual_seed(int(r.params.seed))
            gens.append(g)
        counts = [0] * len(reqs)
        done = [False] * len(reqs)
        active = list(range(len(reqs)))  # tensor row -> request index

        def end(i, text, reason):
            done[i] = True
            finished.add(reqs[i].id)
            reqs[i].on_event(StreamEvent(text=text, n_tokens=counts[i], finish_reason=reason))

        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :].float()
        next_pos = positions[:, -1] + 1
        while True:
            tokens = self._sample(logits, [reqs[i] for i in active], [gens[i] for i in active])
            for row, i in enumerate(active):
                if done[i]:
                    continue
                r, t = reqs[i], tokens[row]
                if r.cancelled:
                    end(i, "", "abort")
                elif t in self.eos:
                    end(i, streams[i].finish(), "stop")
                else:
                    counts[i] += 1
                    delta = streams[i].add(t)
                    if streams[i].stopped:
                        end(i, delta, "stop")
                    elif counts[i] >= r.params.max_new_tokens:
                        delta += streams[i].finish()
                        end(i, delta, "stop" if streams[i].stopped else "length")
                    elif delta:
                        r.on_event(StreamEvent(text=delta, n_tokens=counts[i]))
            keep = [row for row, i in enumerate(active) if not done[i]]
            if not keep:
                return
            step = torch.tensor(tokens, dtype=torch.long, device=dev)
            if can_drop_rows and len(keep) < len(active):
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(idx)
                attn, next_pos, step = attn[idx], next_pos[idx], step[idx]
                active = [active[row] for row in keep]
                self.running = len(active)
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            out = model(input_ids=step[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
