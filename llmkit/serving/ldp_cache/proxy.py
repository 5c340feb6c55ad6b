"""An OpenAI-compatible proxy that puts :class:`LDPCache` in front of any upstream.

Apps keep their OpenAI client and point ``base_url`` at the proxy. Per request:
the user is the request's ``user`` field (else the proxy's default user); all
non-assistant messages are the private query; earlier assistant turns are dropped
(or perturbed and charged, with the cache's ``assistant_turns="perturb"``): they
derive from private text and are never sent as they are. The answer comes from the
cache or from the upstream (perturbed messages only). Each answer carries an ``ldp`` object
(cache_hit, epsilon, spent, remaining) and ``X-LDP-*`` headers. When the next
query could exceed the user's budget the proxy answers HTTP 429 with an
OpenAI-style error (type ``insufficient_quota``, code ``privacy_budget_exceeded``),
the way OpenAI reports exhausted credit, and sends nothing upstream.
``stream: true`` is answered as a stream of one content chunk.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from .accountant import BudgetExceeded
from .upstream import UpstreamError

# request fields passed on to the upstream unchanged
_PASS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
         "presence_penalty", "frequency_penalty")


def _error(message: str, type_: str, status: int, code: str | None = None, param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def build_proxy_app(cache, model_name: str = "ldp-proxy", force_model: str | None = None) -> FastAPI:
    """``force_model`` replaces the model named in requests (else requests choose it)."""
    app = FastAPI(title="llmkit ldp-proxy", docs_url=None, redoc_url=None)
    app.state.cache = cache

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        try:
            ids = await run_in_threadpool(cache.upstream.models)
        except (AttributeError, UpstreamError):
            ids = [model_name]
        return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": "ldp-proxy"} for i in ids]}

    @app.get("/v1/ldp/budget")
    async def budget(user: str | None = None):
        u = user or cache.default_user
        return {"user": u, "budget": cache.ledger.budget(u), "spent": cache.ledger.spent(u),
                "remaining": cache.ledger.remaining(u)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = await request.json()
        except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            return _error("the request body is not valid JSON", "invalid_request_error", 400)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error("'messages' must be a list of {role, content}", "invalid_request_error", 400,
                          param="messages")
        if body.get("n", 1) != 1:
            return _error("ldp-proxy answers n=1 only (each extra sample would cost budget)",
                          "invalid_request_error", 400, param="n")
        user = body.get("user") or None
        params = {k: body[k] for k in _PASS if body.get(k) is not None}
        if force_model:
            params["model"] = force_model
        try:
            ans = await run_in_threadpool(lambda: cache.ask_messages(body["messages"], user=user, params=params))
        except BudgetExceeded as e:
            return _error(str(e), "insufficient_quota", 429, code="privacy_budget_exceeded")
        except ValueError as e:
            return _error(str(e), "invalid_request_error", 400, param="messages")
        except UpstreamError as e:
            return _error(str(e), "upstream_error", 502 if e.status is None or e.status >= 500 else e.status)
        ldp = {"cache_hit": ans.cache_hit, "epsilon": ans.epsilon, "spent": ans.spent,
               "remaining": ans.remaining, "similarity": ans.similarity}
        headers = {"X-LDP-Cache": "hit" if ans.cache_hit else "miss", "X-LDP-Epsilon": f"{ans.epsilon:.6g}",
                   "X-LDP-Remaining": f"{ans.remaining:.6g}"}
        model = (ans.raw or {}).get("model") or body.get("model") or model_name
        cid = (ans.raw or {}).get("id") or f"chatcmpl-ldp-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.get("stream"):
            def events():
                base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
                first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ans.text},
                                              "finish_reason": None}]}
                last = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "ldp": ldp}
                yield f"data: {json.dumps(first)}\n\n"
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        if ans.raw is not None:
            out = dict(ans.raw)
        else:
            out = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": ans.text},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        out["ldp"] = ldp
        return JSONResponse(out, headers=headers)

    return app
