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

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far (before stop truncation)
        self.sent = 0  # characters of self.text already emitted
        self._prefix = 0  # token offsets for windowed decoding
        self._read = 0
        self.stopped = False

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return text that is now safe to emit (may be empty)."""
        self.ids.append(token_id)
        # decode a short window so the cost per token stays constant
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str:
        if self.stop:
            cut = min((i for i in (self.text.find(s) for s in self.stop) if i != -1), default=-1)
            if cut != -1:
                self.text = self.text[:cut]
                self.stopped = True
                final = True
        end = len(self.text)
        if not final and self.stop:
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
