"""An OpenAI-compatible proxy that puts :class:`LDPCache` in front of any upstream.

Apps keep their OpenAI client and point ``base_url`` at the proxy. Per request:
the user is the request's ``user`` field (else the proxy's default user); all
non-assistant messages are the private query; earlier assistant turns are dropped
(or perturbed and charged, with the cache's ``assistant_turns="perturb"``): they
derive from private text and are never sent as they are. The answer comes from the
cache or from the upstream (perturbed messages only). Each answer carries an ``ldp`` object
(cache_hit, epsilon, spent, remaining, budget, similarity, dropped) and the headers
``X-LDP-Cache``, ``X-LDP-Epsilon`` (what this answer cost), ``X-LDP-Spent``,
``X-LDP-Remaining`` and ``X-LDP-Budget``; a refusal carries the last three and
``X-LDP-Needed``. When the next
query could exceed the user's budget the proxy answers HTTP 429 with an
OpenAI-style error (type ``insufficient_quota``, code ``privacy_budget_exceeded``),
the way OpenAI reports exhausted credit, and sends nothing upstream.
``stream: true`` is answered as a stream of one content chunk.

What goes upstream is an allow-list (issue 32): each sent message is its role and its
perturbed content; of the request, ``model`` (only a name the upstream lists, or the
proxy's forced model: a free-form string could carry text) and the sampling numbers of
``client.SAMPLING_PARAMS``. Every other field (``stop``, ``tools``, ``tool_choice``,
``response_format``, ``logit_bias``, ``logprobs``, ...) and every other message key
(``name``, ``tool_calls``, ``tool_call_id``, ...) stays on the device; the answer's
``ldp.dropped`` lists them, so an app can see what the upstream did not get.

With ``proxy_api_key`` every route but ``/health`` needs ``Authorization: Bearer <key>``
(compared in constant time), so another local user cannot spend or probe the budget.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from .accountant import BudgetExceeded
from .client import UPSTREAM_PARAMS, check_params
from .upstream import UpstreamError

# request fields the proxy itself consumes (never sent): the ledger's user, n=1, the stream flag
_LOCAL = ("messages", "user", "n", "stream", "stream_options")
_MESSAGE_KEYS = ("role", "content")


def _error(message: str, type_: str, status: int, code: str | None = None, param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


def _digest(key: str) -> bytes:
    # equal-length digests, so the comparison's time says nothing about the key's length either
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def dropped_fields(body: dict) -> list[str]:
    """The request fields and message keys the proxy keeps from the upstream (module docstring)."""
    out = sorted(k for k in body if k not in UPSTREAM_PARAMS and k not in _LOCAL)
    keys = sorted({k for m in body.get("messages") or [] if isinstance(m, dict) for k in m
                   if k not in _MESSAGE_KEYS})
    return out + [f"messages[].{k}" for k in keys]


def _ldp_headers(spent: float, remaining: float, budget: float) -> dict:
    return {"X-LDP-Spent": f"{spent:.6g}", "X-LDP-Remaining": f"{remaining:.6g}", "X-LDP-Budget": f"{budget:.6g}"}


def build_proxy_app(cache, model_name: str = "ldp-proxy", force_model: str | None = None,
                    proxy_api_key: str | None = None) -> FastAPI:
    """``force_model`` replaces the model named in requests (else requests choose among the upstream's
    models); ``proxy_api_key``: the bearer key clients must send (None: no authentication)."""
    if proxy_api_key is not None and not proxy_api_key.strip():
        raise ValueError("the proxy API key is empty")
    app = FastAPI(title="llmkit ldp-proxy", docs_url=None, redoc_url=None)
    app.state.cache = cache
    want = _digest(proxy_api_key.strip()) if proxy_api_key else None
    listed: list[str] = []
    listed_lock = threading.Lock()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if want is not None and request.url.path != "/health":
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if not hmac.compare_digest(_digest(given.strip() if scheme.lower() == "bearer" else ""), want):
                r = _error("missing or wrong API key for this ldp-proxy (send Authorization: Bearer <key>)",
                           "invalid_request_error", 401, code="invalid_api_key")
                r.headers["WWW-Authenticate"] = "Bearer"
                return r
        return await call_next(request)

    def upstream_models(refresh: bool = False) -> list[str]:
        with listed_lock:
            if refresh or not listed:
                try:
                    listed[:] = cache.upstream.models()
                except (AttributeError, UpstreamError):
                    pass
            return list(listed)

    def upstream_model(requested) -> str | None:
        """The model name to send: forced, or the request's if the upstream lists it (None: its default)."""
        if force_model:
            return force_model
        if requested is None:
            return None
        ids = upstream_models()
        if not ids:  # nothing to check the name against: let the upstream use its default
            return None
        if requested not in ids and requested not in (ids := upstream_models(refresh=True)):
            raise ValueError(f"model {requested!r} is not one of the upstream's models ({', '.join(ids)}); "
                             "the proxy forwards listed names only")
        return requested

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
        b, spent, left = cache.ledger.budget(u), cache.ledger.spent(u), cache.ledger.remaining(u)
        return JSONResponse({"user": u, "budget": b, "spent": spent, "remaining": left},
                            headers=_ldp_headers(spent, left, b))

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
        if user is not None and not isinstance(user, str):
            return _error("'user' must be a string", "invalid_request_error", 400, param="user")
        params = {k: body[k] for k in UPSTREAM_PARAMS if k != "model" and body.get(k) is not None}
        for k, v in params.items():
            try:
                check_params({k: v})
            except ValueError as e:
                return _error(str(e), "invalid_request_error", 400, param=k)
        try:
            model_up = await run_in_threadpool(upstream_model, body.get("model"))
        except ValueError as e:
            return _error(str(e), "invalid_request_error", 400, param="model")
        if model_up is not None:
            params["model"] = model_up
        dropped = dropped_fields(body)
        try:
            ans = await run_in_threadpool(lambda: cache.ask_messages(body["messages"], user=user, params=params))
        except BudgetExceeded as e:
            r = _error(str(e), "insufficient_quota", 429, code="privacy_budget_exceeded")
            r.headers.update({**_ldp_headers(e.spent, max(e.budget - e.spent, 0.0), e.budget),
                              "X-LDP-Needed": f"{e.needed:.6g}"})
            return r
        except ValueError as e:
            return _error(str(e), "invalid_request_error", 400, param="messages")
        except UpstreamError as e:
            return _error(str(e), "upstream_error", 502 if e.status is None or e.status >= 500 else e.status)
        budget_u = cache.ledger.budget(user or cache.default_user)
        ldp = {"cache_hit": ans.cache_hit, "epsilon": ans.epsilon, "spent": ans.spent,
               "remaining": ans.remaining, "budget": budget_u, "similarity": ans.similarity, "dropped": dropped}
        headers = {"X-LDP-Cache": "hit" if ans.cache_hit else "miss", "X-LDP-Epsilon": f"{ans.epsilon:.6g}",
                   **_ldp_headers(ans.spent, ans.remaining, budget_u)}
        asked = body.get("model") if isinstance(body.get("model"), str) else None
        model = (ans.raw or {}).get("model") or model_up or asked or model_name
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
