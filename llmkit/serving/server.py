"""The OpenAI-compatible HTTP server over a streaming engine.

``build_app(engine, ServerConfig(...))`` returns a FastAPI app serving ``/v1/chat/completions``,
``/v1/completions`` (``n``, ``temperature``, ``top_p``, ``max_tokens``, ``stop``, ``seed``, ``stream``;
``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``;
``logprobs``/``top_logprobs`` on chat, ``logprobs``/``echo`` on completions; ``response_format``
json_object/json_schema by grammar-constrained decoding (xgrammar on the transformers engine, vLLM's
structured outputs on vLLM); ``tools``/``tool_choice`` with the answer parsed into ``tool_calls``, streamed as
``tool_calls`` deltas once the answer is complete; a forced ``tool_choice`` (``required`` or a named function)
constrains the answer to one call's JSON), ``/v1/models`` (the model and each LoRA adapter the engine loaded;
a request's ``model`` picks the adapter), ``/health`` and ``/metrics`` (llmkit's names and vLLM's). vLLM's
extra request fields are honoured on both engines, and ``/tokenize``, ``/detokenize`` and ``/version`` answer
as vLLM's server does, so vLLM's own clients (``vllm bench serve``) work unchanged. A field the server cannot
honour is a 400 naming it (protocol.py).

Chat prompts are tokenized with ``engine.encode_chat``: message content is text, so a special-token string
typed into a message never becomes a control token (``llmkit.generation.encode_chat``). The app starts the
engine's background loop (``engine.start_streaming``) on startup and stops it on shutdown, after uvicorn has
let in-flight requests finish.

Limits hold before memory or CPU is spent. A body is refused by its ``Content-Length`` (413) before any of it
is read, and a chunked body stops being read once it passes ``max_body_bytes`` (or ``body_timeout_s`` passes:
408). The parsed request then takes its concurrency slots before anything costly (tokenizing, JSON-schema
checks, grammar compilation): ``max_concurrency`` counts sequences, prompts x ``n``, so one request asking for
more than the whole limit gets 400 naming it, and one that would exceed what is free gets 429 (with
``Retry-After``) at once rather than waiting unboundedly. Each choice is one engine sequence; their events
arrive on the engine thread and are handed to the event loop. A client that leaves (mid-stream or while
waiting) has its sequences cancelled and its slot freed.

Guard hook (``ServerConfig.guard``): after each choice is complete, ``guard.check(engine, messages, text)``
scores it. With ``ServerConfig.guard_prefill`` the prompt's share of the guard's pass starts in a worker
thread when the request arrives (``guard.prefill``) and the check runs only the response tokens; ``annotate``
adds the verdict to the choice, ``block`` replaces a flagged answer with a refusal (finish_reason
``content_filter``), ``correct`` replaces it with ``guard.correct(engine, messages, params)`` and checks the
new answer too: kept when the guard passes it, else refused as ``block`` would; the verdict's ``correction``
says which (``outcome``: corrected | refused | failed, and the new answer's score). With block/correct a
streamed answer is held back until it has been checked.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from llmkit.engines.stream import StreamRequest
from llmkit.generation import GenerationParams
from llmkit.serving.metrics import Metrics, MetricsMiddleware
from llmkit.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    forced_tool_schema,
    new_id,
    now,
    parse,
    parse_tool_calls,
    usage,
)

GUARD_ACTIONS = ("annotate", "block", "correct")
REFUSAL = "I can't help with that request."


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_concurrency: int = 64  # sequences (prompts x n) generating at once; more get 429, more in one request 400
    max_model_len: int = 2048  # prompt + max_tokens, in tokens
    max_batch_size: int = 32  # sequences per engine batch (transformers engine)
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # the whole body must arrive within this (a slow sender gets 408)
    guard: object | None = None
    guard_action: str = "annotate"
    # run the guard's prompt pass beside generation (Guard.prefill): hides it only when a core is free;
    # on a busy CPU it competes with generation and costs one more pass (bench/guard.py --quick: no gain)
    guard_prefill: bool = False
    retry_after_s: int = 1  # the Retry-After header of a 429


class _ClientGone(Exception):
    pass


class _Plan:
    """What one request asks of the engine, worked out before it takes a slot."""

    def __init__(self, chat: bool, req):
        self.chat, self.req = chat, req
        self.adapter: str | None = None
        self.tools: list[dict] | None = None  # offered to the model
        self.parse_tools = False  # parse tool calls out of the answer
        self.forced_tool = False  # tool_choice required / named: the answer is one call (grammar)
        self.grammar = None
        self.prompt_texts: list[str] = []  # completions' echo


class _Server:
    def __init__(self, engine, cfg: ServerConfig):
        if cfg.guard_action not in GUARD_ACTIONS:
            raise ValueError(f"guard action must be one of {', '.join(GUARD_ACTIONS)}")
        self.engine, self.cfg = engine, cfg
        self.metrics = Metrics(cfg.model_name)
        self.streamer = None
        self.active = 0
        self.shutting_down = False
        self.vocab_size = len(engine.tokenizer)
        self.adapters = dict(getattr(engine, "adapters", None) or {})

    # lifecycle ---------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, app):
        kw = {"max_batch_size": self.cfg.max_batch_size} if self.engine.name == "hf" else {}
        self.streamer = self.engine.start_streaming(**kw)
        self.metrics.bind_engine(self.streamer)
        try:
            yield
        finally:
            self.shutting_down = True
            await asyncio.to_thread(self.streamer.stop)

    # request checks ----------------------------------------------------
    def auth(self, request: Request):
        if not self.cfg.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.cfg.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def body(self, request: Request):
        limit = self.cfg.max_body_bytes
        too_large = f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)"
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise APIError(400, f"the Content-Length header is not a byte count: {declared[:40]!r}")
            if int(declared) > limit:  # refused before a byte of it is read
                raise APIError(413, too_large, code="request_too_large")
        raw = bytearray()
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > limit:  # a chunked (or lying) body: stop reading here
                        raise APIError(413, too_large, code="request_too_large")
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.cfg.body_timeout_s:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:
            raise APIError(400, "the client closed the connection before the body was complete") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad syntax, bad encoding, absurd nesting
            raise APIError(400, f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, req, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A chat request's prompt ids with its template options (vLLM's chat fields)."""
        from llmkit.generation import with_special_tokens

        try:
            ids = self.engine.encode_chat(messages, tools=tools, **req.template_options())
        except Exception as e:  # noqa: BLE001 - any template failure is a 400 for these messages
            param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
            raise APIError(400, f"the chat template rejected these messages: {e}", param=param) from None
        return with_special_tokens(self.engine.tokenizer, ids) if req.add_special_tokens else ids

    def truncate(self, req, ids: list[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep that many prompt tokens (the last ones unless
        ``truncation_side`` is right); -1 keeps as many as the context holds with room for one answer token."""
        n, limit = req.truncate_prompt_tokens, self.cfg.max_model_len
        if n is None:
            return ids
        if n > limit:
            raise APIError(400, f"truncate_prompt_tokens={n} is larger than this server's maximum context length "
                           f"({limit})", param="truncate_prompt_tokens")
        if n == -1:
            n = limit - 1
        if len(ids) <= n:
            return ids
        return ids[len(ids) - n:] if (req.truncation_side or "left") == "left" else ids[:n]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names():
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                           + ", ".join(f"'{n}'" for n in self.served_names()), param="model", code="model_not_found")

    async def tokenize(self, request: Request) -> dict:
        """vLLM's ``/tokenize``: a completion prompt, or chat messages rendered as a chat request would be."""
        self.auth(request)
        body = await self.body(request)
        chat = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        self.check_model(req.model)
        if chat:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = self.encode_chat(req, [m.as_dict() for m in req.messages], tools)
        else:
            ids = self.encode(req.prompt, req.add_special_tokens)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        """vLLM's ``/detokenize``: token ids back to text (special tokens kept, as vLLM does)."""
        self.auth(request)
        req = parse(DetokenizeRequest, await self.body(request))
        self.check_model(req.model)
        if any(t < 0 or t >= self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def served_names(self) -> list[str]:
        return [self.cfg.model_name, *self.adapters]

    def pick_model(self, plan: _Plan) -> None:
        name = plan.req.model
        if name is None or name == self.cfg.model_name:
            return
        if name in self.adapters:
            plan.adapter = name
            return
        self.check_model(name)

    def guided(self, plan: _Plan) -> dict | None:
        """The grammar the answer must follow (response_format, or a forced tool call), checked up front."""
        req, guided = plan.req, None
        if req.response_format is not None:
            try:
                guided = req.response_format.guided()
            except ValueError as e:
                raise APIError(400, str(e), param="response_format") from None
        if plan.chat and req.tools and req.tool_choice not in (None, "auto", "none"):
            if guided is not None:
                raise APIError(400, "response_format json_object/json_schema cannot be combined with a forced "
                               "tool_choice (the answer is then the tool call)", param="response_format")
            name = None if req.tool_choice == "required" else req.tool_choice.function.name
            guided = {"json": forced_tool_schema(plan.tools, name)}
            plan.forced_tool = True
        if guided is not None and guided.get("json") is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(guided["json"]).check_schema(guided["json"])
            except jsonschema.SchemaError as e:
                param = "tools" if plan.forced_tool else "response_format"
                raise APIError(400, f"invalid JSON schema: {e.message}", param=param) from None
        return guided

    def plan(self, req, prompt_ids: list[list[int]], extra: dict | None = None) -> list[GenerationParams]:
        """Check lengths and build one GenerationParams per choice (prompt-major order)."""
        limit = self.cfg.max_model_len
        asked = req.requested_max_tokens()
        out = []
        for ids in prompt_ids:
            if not ids:
                raise APIError(400, "the prompt is empty after tokenization", param="prompt")
            room = limit - len(ids)
            if room <= 0:
                raise APIError(400, f"the prompt has {len(ids)} tokens; this server's maximum context length "
                               f"is {limit} tokens (prompt + max_tokens)", param="messages",
                               code="context_length_exceeded")
            if asked is not None and asked > room:
                raise APIError(400, f"max_tokens={asked} is too large: the prompt has {len(ids)} tokens and the "
                               f"maximum context length is {limit}, so at most {room} can be generated",
                               param="max_tokens", code="context_length_exceeded")
            for j in range(req.n):
                seed = None if req.seed is None else req.seed + j
                out.append(GenerationParams(max_new_tokens=asked or room, temperature=req.temperature,
                                            top_p=req.top_p, stop=req.stop_list(), seed=seed, **req.sampling(),
                                            **(extra or {})))
        return out

    @staticmethod
    def sequences(req, chat: bool) -> int:
        """How many engine sequences a request asks for: prompts x n."""
        return req.n * (1 if chat else len(req.prompts()))

    def acquire(self, k: int = 1) -> int:
        """Take ``k`` of the ``max_concurrency`` sequence slots (or refuse at once); returns ``k``."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        limit = self.cfg.max_concurrency
        if k > limit:
            raise APIError(400, f"this request asks for {k} sequences (prompts x n) and this server generates at "
                           f"most {limit} at once (--max-concurrency {limit}); send fewer prompts or a smaller n",
                           param="n", code="too_many_sequences")
        if self.active + k > limit:
            raise APIError(429, f"too many concurrent sequences ({self.active} of {limit} running, this request "
                           f"needs {k}); retry later", type="rate_limit_exceeded", code="too_many_requests",
                           retry_after=self.cfg.retry_after_s)
        self.active += k
        self.metrics.active.set(self.active)
        return k

    def release(self, k: int = 1):
        self.active -= k
        self.metrics.active.set(self.active)

    # generation ----------------------------------------------------------
    def launch(self, prompt_ids, params_list, n, plan: _Plan | None = None):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        reqs = []
        for k, params in enumerate(params_list):
            def on_event(ev, k=k):
                try:
                    loop.call_soon_threadsafe(q.put_nowait, (k, ev))
                except RuntimeError:  # event loop already closed: nobody is listening
                    pass
            reqs.append(StreamRequest(prompt_ids[k // n], params, on_event,
                                      adapter=plan.adapter if plan else None, grammar=plan.grammar if plan else None))
        for r in reqs:
            self.streamer.submit(r)
        return q, reqs

    def guard_prefill(self, messages_list):
        """Start the guard's prompt pass beside generation (one task per prompt), if the guard has one."""
        if self.cfg.guard is None or not self.cfg.guard_prefill or not hasattr(self.cfg.guard, "prefill"):
            return [None] * len(messages_list)
        view = _EngineView(self.engine, self.streamer)
        return [asyncio.ensure_future(asyncio.to_thread(self.cfg.guard.prefill, view, m)) for m in messages_list]

    async def guard_verdict(self, messages, text, params, prefill=None):
        """(text, finish_override, annotation) after the guard looked at one finished choice."""
        guard, action = self.cfg.guard, self.cfg.guard_action
        view = _EngineView(self.engine, self.streamer)
        pre = None
        if prefill is not None:
            try:
                pre = await prefill
            except Exception:  # noqa: BLE001 - any failure: the check then runs its whole pass
                pre = None
        if pre is not None:
            res = await asyncio.to_thread(guard.check, view, messages, text, prefill=pre)
        else:
            res = await asyncio.to_thread(guard.check, view, messages, text)
        flagged, score = bool(res["flagged"]), float(res["score"])
        finish, verdict = None, {"score": score, "flagged": flagged, "action": action if flagged else "none"}
        if flagged:
            self.metrics.guard_flagged.labels(action).inc()
            if action == "block":
                text, finish = REFUSAL, "content_filter"
            elif action == "correct":
                from llmkit.serving.guard.correct import correct_checked

                text, verdict["correction"] = await asyncio.to_thread(correct_checked, guard, view, messages, params)
                if verdict["correction"]["outcome"] != "corrected":  # never send what the guard still rejects
                    text, finish = REFUSAL, "content_filter"
        return text, finish, verdict

    def _record_done(self, prompt_ids, counts, finishes, n, t0):
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompt_ids))
        self.metrics.completion_tokens.inc(sum(counts))
        elapsed = time.perf_counter() - t0
        for i, c in enumerate(counts):
            self.metrics.vllm.finished(len(prompt_ids[i // n]), c, finishes[i] or "abort", elapsed)

    def _first_token(self, t0):
        dt = time.perf_counter() - t0
        self.metrics.ttft.observe(dt)
        self.metrics.vllm.ttft.labels(*self.metrics.vllm.labels).observe(dt)

    def _tool_split(self, plan: _Plan, text: str):
        """``(content, tool_calls)`` of one answer when tools are in play, else ``(text, [])``."""
        if not plan.parse_tools:
            return text, []
        content, calls = parse_tool_calls(text, [t["function"]["name"] for t in plan.tools or []])
        if calls and plan.req.parallel_tool_calls is False:
            calls = calls[:1]
        return content, calls

    def _logprobs(self, plan: _Plan, entries, prompt_entries=None, offset0=0):
        tok = self.engine.tokenizer
        if plan.chat:
            return chat_logprobs(tok, entries)
        return completion_logprobs(tok, (prompt_entries or []) + list(entries), offset0)

    async def complete(self, request, plan: _Plan, prompt_ids, params_list, messages_list):
        req, chat = plan.req, plan.chat
        q, reqs = self.launch(prompt_ids, params_list, req.n, plan)
        prefills = self.guard_prefill(messages_list)
        k = len(reqs)
        texts, counts, finish = [""] * k, [0] * k, [None] * k
        lps: list[list] = [[] for _ in range(k)]
        plps: list = [None] * k
        t0, first = time.perf_counter(), True
        try:
            pending = k
            while pending:
                try:
                    i, ev = await asyncio.wait_for(q.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise _ClientGone() from None
                    continue
                if ev.error:
                    raise APIError(503 if self.shutting_down else 500, f"generation failed: {ev.error}",
                                   type="server_error")
                if first and ev.text:
                    self._first_token(t0)
                    first = False
                texts[i] += ev.text
                counts[i] = ev.n_tokens
                if ev.logprobs:
                    lps[i] += ev.logprobs
                if ev.prompt_logprobs is not None:
                    plps[i] = ev.prompt_logprobs
                if ev.finish_reason:
                    finish[i] = ev.finish_reason
                    pending -= 1
        finally:
            for r in reqs:
                self.streamer.cancel(r)  # no-op for finished ones
        self._record_done(prompt_ids, counts, finish, req.n, t0)
        want_lp = req.logprobs_k() is not None
        choices = []
        for i in range(k):
            choice = {"index": i, "finish_reason": finish[i], "logprobs": None}
            text = texts[i]
            if self.cfg.guard is not None:
                text, override, verdict = await self.guard_verdict(messages_list[i // req.n], text, params_list[i],
                                                                   prefills[i // req.n])
                choice["finish_reason"] = override or finish[i]
                choice["guard"] = verdict
            if chat:
                content, calls = self._tool_split(plan, text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
                if want_lp:
                    choice["logprobs"] = self._logprobs(plan, lps[i])
            else:
                echo = plan.prompt_texts[i // req.n] if req.echo else ""
                choice["text"] = echo + text
                if want_lp:
                    choice["logprobs"] = self._logprobs(plan, lps[i], plps[i] if req.echo else None)
            choices.append(choice)
        return {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": req.model or self.cfg.model_name,
            "choices": choices,
            "usage": usage(sum(len(p) for p in prompt_ids), sum(counts)),
        }

    async def stream(self, plan: _Plan, prompt_ids, params_list, messages_list, reqs_box):
        req, chat = plan.req, plan.chat
        q, reqs = self.launch(prompt_ids, params_list, req.n, plan)
        reqs_box.extend(reqs)
        prefills = self.guard_prefill(messages_list)
        k = len(reqs)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        obj = "chat.completion.chunk" if chat else "text_completion"
        model = req.model or self.cfg.model_name
        # block/correct: the whole answer waits for the guard. With tools offered, text streams as content
        # until it may be a tool call (a <tool_call> tag, or an answer opening with JSON); the call itself
        # goes out as tool_calls deltas once the answer is complete and parsed
        hold = self.cfg.guard is not None and self.cfg.guard_action in ("block", "correct")
        want_lp = req.logprobs_k() is not None
        texts, counts, finishes = [""] * k, [0] * k, [None] * k
        sent = [0] * k  # characters of texts[i] already streamed
        lp_wait: list[list] = [[] for _ in range(k)]
        started = [False] * k

        def chunk(i, text=None, finish=None, extra=None, entries=None, prompt_entries=None, delta=None):
            lp = None
            if want_lp and (entries or prompt_entries):
                offset0 = 0
                lp = self._logprobs(plan, entries or [], prompt_entries, offset0)
            if chat:
                d = delta if delta is not None else ({} if text is None else {"content": text})
                c = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                c = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": lp}
            if extra:
                c.update(extra)
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
            return f"data: {json.dumps(body)}\n\n"

        if chat:
            for i in range(k):
                body = {"id": rid, "object": obj, "created": created, "model": model,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "finish_reason": None, "logprobs": None}]}
                yield f"data: {json.dumps(body)}\n\n"
        t0, first, pending = time.perf_counter(), True, k
        while pending:
            i, ev = await q.get()
            if ev.error:
                err = error_body(f"generation failed: {ev.error}", "server_error")
                yield f"data: {json.dumps(err)}\n\n"
                return
            counts[i] = ev.n_tokens
            if ev.logprobs:
                lp_wait[i] += ev.logprobs
            if not chat and req.echo and not started[i]:  # completions' echo: the prompt comes first
                started[i] = True
                yield chunk(i, plan.prompt_texts[i // req.n], prompt_entries=ev.prompt_logprobs or None)
            if ev.text:
                if first:
                    self._first_token(t0)
                    first = False
                texts[i] += ev.text
                safe = len(texts[i]) if not plan.parse_tools else _tool_safe_prefix(texts[i])
                if not hold and safe > sent[i]:
                    entries, lp_wait[i] = lp_wait[i], []
                    yield chunk(i, texts[i][sent[i]:safe], entries=entries)
                    sent[i] = safe
            if ev.finish_reason:
                pending -= 1
                finishes[i] = ev.finish_reason
                finish, extra = ev.finish_reason, None
                text = texts[i]
                if self.cfg.guard is not None:
                    text, override, verdict = await self.guard_verdict(messages_list[i // req.n], texts[i],
                                                                       params_list[i], prefills[i // req.n])
                    finish, extra = override or finish, {"guard": verdict}
                entries, lp_wait[i] = lp_wait[i], []
                if hold or sent[i] < len(text):
                    content, calls = self._tool_split(plan, text) if chat else (text, [])
                    if hold:
                        rest = content
                    elif not calls:
                        rest = text[sent[i]:]
                    else:  # what was streamed is the start of the content before the first call
                        done = text[:sent[i]].strip()
                        rest = content[len(done):] if content and content.startswith(done) else None
                    if rest:
                        yield chunk(i, rest, entries=entries)
                        entries = []
                    for j, c in enumerate(calls):
                        yield chunk(i, delta={"tool_calls": [{"index": j, **c}]}, entries=entries)
                        entries = []
                    if calls and finish == "stop":
                        finish = "tool_calls"
                yield chunk(i, None, finish, extra, entries=entries)
        self._record_done(prompt_ids, counts, finishes, req.n, t0)
        if req.stream_options is not None and req.stream_options.include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": usage(sum(len(p) for p in prompt_ids), sum(counts))}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    # endpoint --------------------------------------------------------------
    async def prepare(self, req, chat: bool):
        """Check and tokenize one parsed, admitted request: ``(plan, prompt_ids, params_list, messages_list)``."""
        plan = _Plan(chat, req)
        self.pick_model(plan)
        if chat:
            messages = [m.as_dict() for m in req.messages]
            plan.tools = req.active_tools()
            plan.parse_tools = plan.tools is not None
            ids = self.truncate(req, self.encode_chat(req, messages, plan.tools))
            prompt_ids, messages_list = [ids], [messages]
        else:
            prompt_ids, messages_list = [], []
            for p in req.prompts():
                if isinstance(p, str):
                    prompt_ids.append(self.truncate(req, self.encode(p, req.add_special_tokens)))
                    messages_list.append([{"role": "user", "content": p}])
                    plan.prompt_texts.append(p)
                else:
                    if any(t < 0 or t >= self.vocab_size for t in p):
                        raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
                    prompt_ids.append(self.truncate(req, list(p)))
                    text = self.engine.tokenizer.decode(p)
                    messages_list.append([{"role": "user", "content": text}])
                    plan.prompt_texts.append(text)
        guided = self.guided(plan)
        k = req.logprobs_k()
        extra = {"logprobs": k, "guided": guided}
        if not chat and req.echo and k is not None:
            extra["prompt_logprobs"] = k
        params_list = self.plan(req, prompt_ids, extra)
        if guided is not None:
            try:
                plan.grammar = await asyncio.to_thread(self.engine.compile_grammar, guided)
            except Exception as e:  # noqa: BLE001 - the grammar compiler's complaint is about this request
                raise APIError(400, f"cannot build a grammar for this schema: {e}",
                               param="tools" if plan.forced_tool else "response_format") from None
        return plan, prompt_ids, params_list, messages_list

    async def handle(self, request: Request, chat: bool):
        slots = 0
        try:
            self.auth(request)
            req = parse(ChatRequest if chat else CompletionRequest, await self.body(request))
            # admitted before tokenizing, schema checks and grammar compilation, so the limit bounds them too
            slots = self.acquire(self.sequences(req, chat))
            plan, prompt_ids, params_list, messages_list = await self.prepare(req, chat)
        except APIError as e:
            if slots:
                self.release(slots)
            self.metrics.errors.labels(e.type).inc()
            return e.response()
        except BaseException:
            if slots:
                self.release(slots)
            raise
        self.metrics.vllm.max_tokens.labels(*self.metrics.vllm.labels).observe(params_list[0].max_new_tokens)
        self.metrics.vllm.n.labels(*self.metrics.vllm.labels).observe(req.n)

        if req.stream:
            reqs: list[StreamRequest] = []
            released = threading.Event()

            def cleanup():
                for r in reqs:
                    self.streamer.cancel(r)
                if not released.is_set():
                    released.set()
                    self.release(slots)

            return _SSEResponse(self.stream(plan, prompt_ids, params_list, messages_list, reqs), cleanup)
        try:
            return JSONResponse(await self.complete(request, plan, prompt_ids, params_list, messages_list))
        except APIError as e:
            self.metrics.errors.labels(e.type).inc()
            return e.response()
        except _ClientGone:
            self.metrics.errors.labels("client_disconnected").inc()
            return Response(status_code=499)
        finally:
            self.release(slots)


TOOL_TAG = "<tool_call>"


def _tool_safe_prefix(text: str) -> int:
    """How much of a growing answer can stream as content while tools are offered.

    Nothing while the answer may be a bare JSON call (it opens with ``{`` or ``[``, or is blank so
    far); otherwise everything before a ``<tool_call>`` tag, holding back a tail that may begin one.
    """
    head = text.lstrip()
    if not head or head[0] in "{[":
        return 0
    cut = text.find(TOOL_TAG)
    if cut != -1:
        return cut
    for n in range(min(len(TOOL_TAG) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_TAG[:n]):
            return len(text) - n
    return len(text)


class _EngineView:
    """The engine as the guard sees it: ``generate`` goes through the running stream loop.

    The loop's thread owns the engine while serving (vLLM's engine must not be
    stepped from two threads), so a guard's regeneration is one more request
    in the next batch rather than a second generation beside it.
    """

    def __init__(self, engine, streamer):
        self._engine, self._streamer = engine, streamer

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompts, params: GenerationParams, n: int = 1, progress: bool = False):
        from llmkit.engines.stream import collect
        from llmkit.generation import prompt_ids

        # a ChatPrompt's safe ids where content held markup
        ids = [prompt_ids(self._engine.tokenizer, p) for p in prompts for _ in range(n)]
        out = collect(self._streamer, ids, [params] * len(ids))
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]


class _SSEResponse(StreamingResponse):
    """Server-sent events whose cleanup (cancel sequences, free the slot) runs however the stream ends."""

    def __init__(self, gen, cleanup):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._gen, self._cleanup = gen, cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()
            await self._gen.aclose()


def build_app(engine, cfg: ServerConfig) -> FastAPI:
    server = _Server(engine, cfg)
    app = FastAPI(title="llmkit", lifespan=server.lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(MetricsMiddleware, metrics=server.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        server.metrics.errors.labels("invalid_request_error").inc()
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        server.metrics.errors.labels("server_error").inc()
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            server.auth(request)
        except APIError as e:
            server.metrics.errors.labels(e.type).inc()
            return e.response()
        created = now()
        data = [{"id": cfg.model_name, "object": "model", "created": created, "owned_by": "llmkit",
                 "root": getattr(engine, "model_name", cfg.model_name), "parent": None,
                 "max_model_len": cfg.max_model_len}]
        for name, path in server.adapters.items():  # each LoRA adapter is a model of its own (as in vLLM)
            data.append({"id": name, "object": "model", "created": created, "owned_by": "llmkit", "root": str(path),
                         "parent": cfg.model_name, "max_model_len": cfg.max_model_len})
        return {"object": "list", "data": data}

    async def _answer(handler, request):
        try:
            return JSONResponse(await handler(request))
        except APIError as e:
            server.metrics.errors.labels(e.type).inc()
            return e.response()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _answer(server.tokenize, request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _answer(server.detokenize, request)

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            v = dist_version("llmkit")
        except PackageNotFoundError:
            v = "unknown"
        return {"version": v, "engine": engine.name}

    @app.get("/health")
    async def health():
        ok = server.streamer is not None and not server.shutting_down
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": cfg.model_name,
                             "engine": engine.name}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class BackgroundServer:
    """Run an app with uvicorn in a thread on loopback (tests, benchmarks): ``with BackgroundServer(app) as s: s.url``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        # port 0: the socket bound here is the one uvicorn serves on, so no other process can take the port
        # between choosing it and listening (a chosen-then-closed port was taken by a parallel test's server)
        self._sock = None
        if port == 0:
            self._sock = socket.socket()
            self._sock.bind((host, 0))
            port = self._sock.getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=30, backlog=4096))
        sockets = {"sockets": [self._sock]} if self._sock is not None else {}
        self.thread = threading.Thread(target=self.server.run, kwargs=sockets, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)
        if self._sock is not None:
            self._sock.close()


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; uvicorn then stops accepting and lets in-flight requests finish."""
    import signal

    import uvicorn

    # uvicorn re-raises the signal it caught once it has shut down; for SIGTERM that would end the
    # process with -15 after a clean shutdown, so let it land on a handler that just returns (exit 0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30, backlog=4096)
    finally:
        signal.signal(signal.SIGTERM, previous)
