"""Streaming submission shared by the engines: requests in, token/text deltas out.

Serving needs more than ``Engine.generate``: requests arrive one at a time from
many clients, must be batched together, stream their text as it is made, and
stop early when the client goes away. Each engine gets a background thread
(``StreamLoop``) that owns the model; callers ``submit`` a ``StreamRequest``
from any thread and receive ``StreamEvent``s through the request's callback,
which runs on the engine thread (the server hops them onto its event loop).

``TextStream`` turns a growing list of token ids into safe text deltas: it
decodes incrementally (holding back a trailing partial UTF-8 character) and
cuts at stop strings, holding back any tail that could still become one, so a
streamed answer is exactly the non-streamed one split into pieces.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from llmkit.generation import GenerationParams

_ids = itertools.count()


@dataclass
class StreamEvent:
    text: str = ""  # new text since the previous event
    n_tokens: int = 0  # tokens generated so far (completion tokens)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None
    # with params.logprobs: one (token_id, logprob, [(id, logprob), ...top]) per token since the last event
    logprobs: list | None = None
    # with params.prompt_logprobs, on the first event: (first_id, None, []) for the first prompt token, then entries as above
    prompt_logprobs: list | None = None


@dataclass
class StreamRequest:
    prompt_ids: list[int]
    params: GenerationParams
    on_event: Callable[[StreamEvent], None]
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cancelled: bool = False  # set by cancel(); the engine drops the request at its next step
    adapter: str | None = None  # a LoRA adapter's name (the engine's load_adapters); None = the base model
    grammar: object | None = None  # the engine's compiled grammar (compile_grammar) for params.guided


class TextStream:
    """Incremental detokenization plus stop strings for one sequence."""

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: cut after the stop string
        self.min_tokens = min_tokens  # as in vLLM, no stop string may end within the first min_tokens tokens
        self._floor = 0  # length of the text those tokens made
        self._decode_kw = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:  # only sent when off: it is the tokenizers' default
            self._decode_kw["spaces_between_special_tokens"] = False
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (before stop truncation)
        self.sent = 0  # characters of self.text already emitted
        self._prefix = 0  # token offsets for windowed decoding
        self._read = 0
        self.stopped = False

    @classmethod
    def for_params(cls, tokenizer, params: GenerationParams) -> TextStream:
        """The stream for one request's text options (stop strings and vLLM's detokenization flags)."""
        return cls(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   include_stop=params.include_stop_str_in_output, min_tokens=params.min_tokens)

    def _decode(self, ids):
        return self.tok.decode(ids, **self._decode_kw)

    def add(self, token_id: int) -> str:
        """Append one token; return text that is now safe to emit (may be empty)."""
        self.ids.append(token_id)
        # decode a short window so the cost per token stays constant
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        if len(self.ids) <= self.min_tokens:
            self._floor = len(self.text)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        if self.stop and len(self.ids) > self.min_tokens:
            hits = [(i, s) for i, s in ((self.text.find(s, max(0, self._floor - len(s) + 1)), s) for s in self.stop)
                    if i != -1]
            if hits:
                cut, s = min(hits)
                self.text = self.text[:cut + len(s) if self.include_stop else cut]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop and not self.include_stop:
            # hold back a tail that may be the start of a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def finish(self) -> str:
        """Flush everything left (called when the sequence ends for a reason other than a stop string)."""
        # a trailing partial character that never completed is decoded as-is
        tail = self._decode(self.ids[self._prefix:])
        head = self._decode(self.ids[self._prefix:self._read])
        if len(tail) > len(head):
            self.text += tail[len(head):]
            self._prefix = self._read = len(self.ids)
        return self._emit(final=True)


def collect(loop: StreamLoop, prompts: list[list[int]], params: list[GenerationParams]) -> list:
    """Run one request per ``(prompt ids, params)`` through a started loop; ``Completion``s in order.

    The text is what the stream sent; ``token_ids`` stay empty (events carry text).
    """
    from llmkit.generation import Completion

    jobs = []
    for ids, p in zip(prompts, params):
        done, parts, last = threading.Event(), [], []

        def on_event(ev, done=done, parts=parts, last=last):
            parts.append(ev.text)
            if ev.finish_reason:
                last.append(ev)
                done.set()
        loop.submit(StreamRequest(list(ids), p, on_event))
        jobs.append((ids, done, parts, last))
    out = []
    for ids, done, parts, last in jobs:
        done.wait()
        ev = last[0]
        if ev.error:
            raise RuntimeError(f"generation failed: {ev.error}")
        finish = "length" if ev.finish_reason == "length" else "stop"
        out.append(Completion("".join(parts), len(ids), ev.n_tokens, finish, []))
    return out


class StreamLoop:
    """A background thread that owns an engine's model and serves ``StreamRequest``s."""

    def __init__(self, name: str):
        self._inbox: queue.Queue[StreamRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run_forever, name=name, daemon=True)
        self._stopping = False
        self.waiting = 0  # requests submitted but not yet running (queue depth)
        self.running = 0

    def start(self):
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def submit(self, req: StreamRequest) -> None:
        if self._stopping:
            req.on_event(StreamEvent(finish_reason="error", error="server is shutting down"))
            return
        self.waiting += 1
        self._inbox.put(req)

    def cancel(self, req: StreamRequest) -> None:
        req.cancelled = True

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _take(self, block: bool, limit: int) -> list[StreamRequest]:
        """Pending requests, at most ``limit``; blocks for the first one when ``block``."""
        out = []
        while len(out) < limit:
            try:
                item = self._inbox.get(block=block and not out, timeout=None)
            except queue.Empty:
                break
            if item is None:
                self._stopping = True
                break
            self.waiting -= 1
            if item.cancelled:
                item.on_event(StreamEvent(finish_reason="abort"))
                continue
            out.append(item)
        return out

    def _run_forever(self):
        try:
            self._loop()
        finally:
            # whatever is still queued gets a clean error instead of hanging forever
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self.waiting -= 1
                    item.on_event(StreamEvent(finish_reason="error", error="server is shutting down"))

    def _loop(self):  # pragma: no cover - implemented by engines
        raise NotImplementedError
