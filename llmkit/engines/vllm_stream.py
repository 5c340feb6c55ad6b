"""Streaming submission over vLLM's engine (the serving path of ``VLLMEngine``).

One thread owns ``LLM.llm_engine`` and drives it the way ``LLM.generate``
does (``add_request`` + ``step`` until done), but requests are added as they
arrive, so vLLM's scheduler batches them continuously, and outputs are
requested as deltas (``RequestOutputKind.DELTA``) so text streams per step.
Cancelled requests are aborted in vLLM, which frees their KV blocks.

This keeps vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` works on
CPU); vLLM's ``AsyncLLM`` always runs its engine core in another process,
which needs the ``__main__`` guard and would double the memory on CPU.
"""

from __future__ import annotations

from llmkit.engines.stream import StreamEvent, StreamLoop


class VLLMStreamer(StreamLoop):
    def __init__(self, engine):
        super().__init__(name="llmkit-vllm-loop")
        self.engine = engine
        self.live = {}  # request id -> StreamRequest
        self.counts = {}

    def _add(self, r):
        from vllm.sampling_params import RequestOutputKind

        from llmkit.engines.vllm import to_sampling_params

        sp = to_sampling_params(r.params)
        sp.output_kind = RequestOutputKind.DELTA
        try:
            lora = None
            if r.adapter is not None:
                lora = self.engine.lora_requests[r.adapter]
            self.engine.llm.llm_engine.add_request(r.id, {"prompt_token_ids": list(r.prompt_ids)}, sp,
                                                   lora_request=lora)
        except Exception as e:  # noqa: BLE001 - a request vLLM refuses must not stop the loop
            r.on_event(StreamEvent(finish_reason="error", error=f"{type(e).__name__}: {e}"))
            return
        self.live[r.id] = r
        self.counts[r.id] = 0

    def _drop(self, rid):
        self.live.pop(rid, None)
        self.counts.pop(rid, None)

    def _loop(self):
        eng = self.engine.llm.llm_engine
        while self.live or not self._stopping:
            for r in self._take(block=not self.live and not self._stopping, limit=4096):
                self._add(r)
            gone = [rid for rid, r in self.live.items() if r.cancelled]
            if gone:
                eng.abort_request(gone)
                for rid in gone:
                    self.live[rid].on_event(StreamEvent(finish_reason="abort"))
                    self._drop(rid)
            self.running = len(self.live)
            if not self.live:
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - a failing step fails its requests, not the loop
                for r in self.live.values():
                    r.on_event(StreamEvent(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                self.live.clear()
                self.counts.clear()
                continue
            for out in outputs:
                r = self.live.get(out.request_id)
                if r is None or not out.outputs:
                    continue
                o = out.outputs[0]
                self.counts[r.id] += len(o.token_ids)
                finish = None
                if out.finished:
                    finish = {"length": "length", "abort": "abort"}.get(str(o.finish_reason), "stop")
                lps = _entries(o.token_ids, o.logprobs, r.params.logprobs) if r.params.logprobs is not None else None
                plps = None
                if r.params.prompt_logprobs is not None and getattr(out, "prompt_logprobs", None):
                    plps = [(r.prompt_ids[0], None, [])] + _entries(list(r.prompt_ids)[1:], out.prompt_logprobs[1:], r.params.prompt_logprobs)
                if o.text or finish or lps or plps:
                    r.on_event(StreamEvent(text=o.text, n_tokens=self.counts[r.id], finish_reason=finish,
                                           logprobs=lps or None, prompt_logprobs=plps))
                if out.finished:
                    self._drop(r.id)
        self.running = 0


def _entries(token_ids, logprobs, k: int) -> list:
    """vLLM's per-position ``{token_id: Logprob}`` as llmkit's ``(token, logprob, [(id, logprob) top k])``."""
    out = []
    for t, d in zip(token_ids, logprobs or []):
        if d is None:
            continue
        chosen = d.get(t)
        top = sorted(((tid, lp) for tid, lp in d.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda x: x[1].rank)[:k]
        out.append((int(t), float(chosen.logprob) if chosen is not None else float("-inf"),
                    [(int(tid), float(lp.logprob)) for tid, lp in top]))
    return out
