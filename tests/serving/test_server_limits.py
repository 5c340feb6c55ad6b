"""The server holds its limits before it spends memory or CPU.

Body limits are driven through the ASGI interface with a ``receive`` that counts what the
server pulled (so "stopped reading" is measured, not inferred), and once over a real socket;
admission, sequence counting and the guard's checked correction over loopback.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from llmkit.engines.hf import HFEngine
from llmkit.serving.server import REFUSAL, BackgroundServer, ServerConfig, build_app
from llmkit.testing import tiny_llama, tiny_tokenizer

MSG = [{"role": "user", "content": "hello"}]
CHAT = "/v1/chat/completions"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def engine():
    return HFEngine(tiny_llama(), tiny_tokenizer())


def _app(engine, **cfg):
    cfg.setdefault("max_model_len", 1024)
    return build_app(engine, ServerConfig(model_name="tiny", **cfg))


class Body:
    """An ASGI ``receive`` handing out ``total`` bytes in ``chunk``-sized pieces; counts what was pulled."""

    def __init__(self, total: int, chunk: int = 16 << 10, stall_after: int | None = None):
        self.total, self.chunk, self.stall_after, self.pulled = total, chunk, stall_after, 0

    async def __call__(self):
        if self.stall_after is not None and self.pulled >= self.stall_after:
            await asyncio.sleep(3600)  # a sender that stops sending
        n = min(self.chunk, self.total - self.pulled)
        self.pulled += n
        return {"type": "http.request", "body": b"x" * n, "more_body": self.pulled < self.total}


def asgi_post(app, body: Body, content_length: int | None, timeout: float = 20.0):
    """POST /v1/chat/completions straight into the app; ``(status, json body)``."""
    headers = [(b"content-type", b"application/json"), (b"host", b"test")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, body, send), timeout))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


def test_content_length_over_the_limit_is_refused_before_reading(engine):
    app = _app(engine, max_body_bytes=LIMIT)
    body = Body(8 << 20)
    status, err = asgi_post(app, body, content_length=300_000_000)
    assert status == 413 and "--max-body-bytes" in err["error"]["message"]
    assert body.pulled == 0  # not one byte of the body was read


def test_chunked_body_stops_being_read_past_the_limit(engine):
    app = _app(engine, max_body_bytes=LIMIT)
    body = Body(8 << 20)
    status, err = asgi_post(app, body, content_length=None)
    assert status == 413 and err["error"]["code"] == "request_too_large"
    assert body.pulled <= LIMIT + body.chunk  # read up to the limit, then stopped


def test_body_that_lies_about_its_length_stops_at_the_limit(engine):
    app = _app(engine, max_body_bytes=LIMIT)
    body = Body(8 << 20)
    status, _ = asgi_post(app, body, content_length=100)
    assert status == 413 and body.pulled <= LIMIT + body.chunk


def test_slow_body_times_out_with_408(engine):
    app = _app(engine, body_timeout_s=0.5)
    body = Body(1 << 20, stall_after=1024)
    t0 = time.perf_counter()
    status, err = asgi_post(app, body, content_length=1 << 20)
    assert status == 408 and "0.5 s" in err["error"]["message"]
    assert time.perf_counter() - t0 < 10


def test_a_content_length_that_is_no_number_is_a_400(engine):
    headers = [(b"content-length", b"12abc")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = []

    async def send(m):
        sent.append(m)

    asyncio.run(_app(engine)(scope, Body(10), send))
    assert sent[0]["status"] == 400
    assert "Content-Length" in json.loads(sent[1]["body"])["error"]["message"]


def test_huge_declared_body_is_answered_at_once_over_a_socket(engine):
    """A 300 MB Content-Length gets its 413 while the client has sent only 1 KB of it."""
    with BackgroundServer(_app(engine)) as srv:
        with socket.create_connection((srv.host, srv.port), timeout=10) as sock:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 300000000\r\n\r\n".encode() + b"{" + b" " * 1023)
            head = sock.recv(65536).decode("latin-1")  # times out (a test failure) if the server waits
        assert head.startswith("HTTP/1.1 413")
        ok = httpx.post(srv.url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


# -- admission and sequence counting --------------------------------------------------------------------


def test_a_request_larger_than_the_whole_limit_is_a_400_at_once(engine):
    with BackgroundServer(_app(engine, max_concurrency=8)) as srv:
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": ["once upon a time"] * 64, "n": 16, "max_tokens": 64})
        assert time.perf_counter() - t0 < 5
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "n" and "1024 sequences" in err["message"] and "--max-concurrency 8" in err["message"]
        r = httpx.post(srv.url + CHAT, json={"messages": MSG, "n": 9, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and err["code"] == r.json()["error"]["code"] == "too_many_sequences"
        r = httpx.post(srv.url + CHAT, json={"messages": MSG, "n": 8, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_sequences_count_against_the_limit_and_admission_comes_before_tokenizing(engine, monkeypatch):
    app = _app(engine, max_concurrency=4)
    state = app.state.server
    encoded = []
    real = engine.encode_chat
    monkeypatch.setattr(engine, "encode_chat", lambda *a, **k: (encoded.append(1), real(*a, **k))[1])
    with BackgroundServer(app) as srv:
        body = {"messages": MSG, "max_tokens": 900, "n": 3, "stream": True, "temperature": 0}  # greedy: no early EOS
        with httpx.stream("POST", srv.url + CHAT, json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)  # three sequences are running
            assert state.active == 3 and len(encoded) == 1
            big = [{"role": "user", "content": "word " * 20000}]
            busy = httpx.post(srv.url + CHAT, json={"messages": big, "n": 2, "max_tokens": 2}, timeout=60)
            assert busy.status_code == 429 and "needs 2" in busy.json()["error"]["message"]
            assert len(encoded) == 1  # refused before its prompt was tokenized
            schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
            busy = httpx.post(srv.url + CHAT, timeout=60,
                              json={"messages": MSG, "n": 2, "max_tokens": 2, "response_format": schema})
            assert busy.status_code == 429 and len(encoded) == 1
            one = httpx.post(srv.url + CHAT, json={"messages": MSG, "max_tokens": 2}, timeout=60)
            assert one.status_code == 200  # the fourth slot was free
        deadline = time.time() + 20
        while state.active and time.time() < deadline:
            time.sleep(0.05)
        assert state.active == 0


def test_a_request_refused_after_admission_frees_its_slots(engine):
    app = _app(engine, max_concurrency=4, max_model_len=64)
    state = app.state.server
    with BackgroundServer(app) as srv:
        long = [{"role": "user", "content": "word " * 200}]
        r = httpx.post(srv.url + CHAT, json={"messages": long, "n": 4, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert state.active == 0


# -- the guard's correction is checked ------------------------------------------------------------------


class Guard:
    """Flags answers to 'attack'; the correction passes or not as told, or raises."""

    def __init__(self, correction_passes=True, broken=False):
        self.correction_passes, self.broken, self.checked = correction_passes, broken, []

    def check(self, engine, messages, response_text):
        self.checked.append(response_text)
        flagged = "attack" in messages[-1]["content"]
        if response_text == "fixed":
            flagged = not self.correction_passes
        return {"score": 9.0 if flagged else 0.1, "flagged": flagged}

    def correct(self, engine, messages, params):
        if self.broken:
            raise RuntimeError("no engine")
        return "fixed"


@pytest.mark.parametrize("case", ["corrected", "refused", "failed"])
def test_guard_correct_checks_the_regenerated_answer(engine, case):
    guard = Guard(correction_passes=case == "corrected", broken=case == "failed")
    with BackgroundServer(_app(engine, guard=guard, guard_action="correct")) as srv:
        for stream in (False, True):
            r = httpx.post(srv.url + CHAT, timeout=60, json={"messages": [{"role": "user", "content": "attack"}],
                                                             "max_tokens": 3, "stream": stream})
            assert r.status_code == 200
            if stream:
                events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
                last = events[-1]["choices"][0]
                finish, verdict = last["finish_reason"], last["guard"]
            else:
                choice = r.json()["choices"][0]
                text, finish, verdict = choice["message"]["content"], choice["finish_reason"], choice["guard"]
            assert verdict["action"] == "correct" and verdict["correction"]["outcome"] == case
            if case == "corrected":
                assert text == "fixed" and finish != "content_filter" and verdict["correction"]["flagged"] is False
            else:
                assert text == REFUSAL and finish == "content_filter"
            if case == "failed":
                assert "no engine" in verdict["correction"]["error"]
    if case != "failed":
        assert "fixed" in guard.checked  # the regenerated answer went through the guard


def test_serve_flags_reach_the_server_config(monkeypatch):
    import llmkit.commands.serve as serve_cmd
    import llmkit.serving.server as server_mod
    from llmkit.cli import build_parser

    seen = {}

    class Dummy:
        name = "hf"

        def close(self):
            pass

    monkeypatch.setattr(serve_cmd, "build_engine", lambda args: Dummy())
    monkeypatch.setattr(server_mod, "build_app", lambda engine, cfg: seen.setdefault("cfg", cfg))
    monkeypatch.setattr(server_mod, "serve", lambda app, **kw: None)
    args = build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--body-timeout", "2.5",
                                      "--max-concurrency", "3"])
    assert serve_cmd.run(args) == 0
    cfg = seen["cfg"]
    assert (cfg.max_body_bytes, cfg.body_timeout_s, cfg.max_concurrency) == (1000, 2.5, 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-body-bytes", "0"])


def test_hostile_clients_over_a_real_socket(engine):
    """The bench's hostile senders: refused early, a slow but complete body still answered."""
    from llmkit.experiments.hostile_http import chunked_flood, declared_oversize, trickle

    app = _app(engine, max_body_bytes=LIMIT, body_timeout_s=1.0)
    good = json.dumps({"messages": MSG, "max_tokens": 2}).encode()
    with BackgroundServer(app) as srv:
        async def run():
            return await asyncio.gather(
                declared_oversize(srv.host, srv.port, CHAT, 300_000_000),
                chunked_flood(srv.host, srv.port, CHAT, cap=256 << 20),
                trickle(srv.host, srv.port, CHAT, good, pieces=4, delay=0.1),
                trickle(srv.host, srv.port, CHAT, good, pieces=4, delay=0.1, stall=True))

        big, flood, slow, stalled = asyncio.run(run())
    assert big["status"] == 413 and big["sent"] == 1024
    assert flood["status"] == 413 and flood["sent"] < 64 << 20  # answered long before the 256 MB were sent
    assert slow["status"] == 200 and json.loads(slow["text"])["choices"]
    assert stalled["status"] == 408 and stalled["seconds"] < 10
