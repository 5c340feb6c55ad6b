"""The OpenAI-compatible server, driven over loopback with the openai client and raw HTTP.

Most tests share one server over the tiny in-process model; the guard, auth,
limit and KV-cache tests build their own apps (each app has its own metrics
registry, so several live in one process).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from llmkit.engines.hf import HFEngine
from llmkit.generation import GenerationParams
from llmkit.serving.server import BackgroundServer, ServerConfig, build_app
from llmkit.testing import tiny_llama, tiny_tokenizer

MSG = [{"role": "user", "content": "hello"}]


def make_server(engine=None, **cfg):
    engine = engine or HFEngine(tiny_llama(), tiny_tokenizer())
    cfg.setdefault("max_model_len", 256)
    app = build_app(engine, ServerConfig(model_name="tiny", **cfg))
    return BackgroundServer(app), app, engine


@pytest.fixture(scope="module")
def srv():
    server, app, engine = make_server()
    with server:
        server.app, server.engine = app, engine
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


def metric(url, name, labels=""):
    text = httpx.get(url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + (("{" + labels + "}") if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def reference(engine, prompt, max_tokens, **kw):
    return engine.generate([prompt], GenerationParams(max_new_tokens=max_tokens, **kw))[0][0]


def test_chat_matches_offline_generation_and_counts_usage(srv):
    r = srv.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)
    prompt = srv.engine.chat_prompt(MSG)
    ref = reference(srv.engine, prompt, 12)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(srv.engine.tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == n_prompt + ref.completion_tokens


def test_completions_with_several_prompts_and_n(srv):
    r = srv.client.completions.create(model="tiny", prompt=["abc", "a longer prompt"], max_tokens=6, n=2,
                                      temperature=0)
    assert r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for k, p in enumerate(["abc", "a longer prompt"]):
        ref = reference(srv.engine, p, 6)
        assert r.choices[2 * k].text == r.choices[2 * k + 1].text == ref.text  # greedy: n copies
    assert r.usage.prompt_tokens == len("abc") + len("a longer prompt")  # byte-level tokenizer


def test_sampling_seed_is_reproducible_and_choices_differ(srv):
    kw = {"model": "tiny", "messages": MSG, "max_tokens": 16, "temperature": 1.0, "n": 2, "seed": 123}
    a = srv.client.chat.completions.create(**kw)
    b = srv.client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    c = srv.client.chat.completions.create(**{**kw, "seed": 999})
    assert c.choices[0].message.content != a.choices[0].message.content


def test_stop_string_cuts_output(srv):
    full = srv.client.completions.create(model="tiny", prompt="stop test", max_tokens=24, temperature=0)
    text = full.choices[0].text
    # a stop string taken from the middle of the greedy answer
    k = next(i for i in range(3, len(text)) if text[i] not in "\ufffd" and text.find(text[i]) == i)
    stop = text[k]
    for stream in (False, True):
        r = srv.client.completions.create(model="tiny", prompt="stop test", max_tokens=24, temperature=0,
                                          stop=[stop], stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert got == text[:k] and finish == "stop"


def test_streaming_chat_gives_incremental_chunks_ending_with_done(srv):
    ref = srv.client.chat.completions.create(model="tiny", messages=MSG, max_tokens=20, temperature=0)
    body = {"model": "tiny", "messages": MSG, "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for t in contents if t) > 2  # really incremental, not one blob
    assert "".join(t or "" for t in contents) == ref.choices[0].message.content
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == ref.usage.model_dump(exclude_none=True)
    assert chunks[-2]["choices"][0]["finish_reason"] == ref.choices[0].finish_reason


def test_concurrent_requests_share_batches(srv):
    batcher = srv.app.state.server.streamer
    before = batcher.batches
    results = [None] * 8

    def call(i):
        results[i] = srv.client.completions.create(model="tiny", prompt=f"p{i}" * (i + 1), max_tokens=12,
                                                   temperature=0).choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert batcher.batches - before < 8
    assert batcher.max_batch_seen >= 3
    for i in range(8):  # batching (left padding, dropped rows) does not change answers
        assert results[i] == reference(srv.engine, f"p{i}" * (i + 1), 12).text


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'["a list"]', 400, None),
    (b'{"messages": []}', 400, "messages"),
    (b'{"messages": "hi"}', 400, "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages.0.role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400, "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 1000}', 400, "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}', 400, "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}', 404, "model"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "' + b"y" * 400 + b'"}]}', 400, "messages"),
])
def test_bad_requests_get_openai_errors_and_server_keeps_serving(srv, body, status, param):
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    ok = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_openai_client_raises_on_errors(srv):
    with pytest.raises(openai.NotFoundError):
        srv.client.chat.completions.create(model="other", messages=MSG, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        srv.client.completions.create(model="tiny", prompt="z" * 300, max_tokens=2)
    r = httpx.get(srv.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_models_health_and_metrics_move(srv):
    assert [m.id for m in srv.client.models.list().data] == ["tiny"]
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    ok0 = metric(srv.url, "llmkit_requests_total", 'path="/v1/completions",status="200"')
    bad0 = metric(srv.url, "llmkit_requests_total", 'path="/v1/completions",status="400"')
    tok0 = metric(srv.url, "llmkit_completion_tokens_total")
    lat0 = metric(srv.url, "llmkit_request_latency_seconds_count", 'path="/v1/completions"')
    srv.client.completions.create(model="tiny", prompt="metrics", max_tokens=5, temperature=0)
    httpx.post(srv.url + "/v1/completions", content=b"{")
    assert metric(srv.url, "llmkit_requests_total", 'path="/v1/completions",status="200"') == ok0 + 1
    assert metric(srv.url, "llmkit_requests_total", 'path="/v1/completions",status="400"') == bad0 + 1
    assert metric(srv.url, "llmkit_completion_tokens_total") >= tok0 + 1
    assert metric(srv.url, "llmkit_request_latency_seconds_count", 'path="/v1/completions"') == lat0 + 1
    assert "llmkit_queue_depth" in httpx.get(srv.url + "/metrics").text


def test_api_key_required():
    server, _, _ = make_server(api_key="sekrit")
    with server:
        body = {"messages": MSG, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_concurrency_limit_and_disconnect_frees_slot():
    # the first stream must still hold the slot when the second request arrives: it may not stop at an EOS, and
    # each step takes at least 20 ms (on a loaded machine the tiny model's 1000 tokens once finished in the gap
    # between the first chunk and the second request, which then got its slot)
    engine = HFEngine(tiny_llama(), tiny_tokenizer())
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(0.02))
    server, app, _ = make_server(engine, max_concurrency=1, max_model_len=1024)
    state = app.state.server
    with server:
        body = {"messages": MSG, "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)  # the stream is running and holds the only slot
            busy = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_exceeded"
        # the client hung up after one chunk: the slot and the engine row come free long before the 1000 tokens
        # (20 s at the least)
        deadline = time.time() + 8
        while (state.active or state.streamer.running) and time.time() < deadline:
            time.sleep(0.05)
        assert state.active == 0 and state.streamer.running == 0
        ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


class FakeGuard:
    """Flags any answer to a message containing 'attack'; records what it was given."""

    def __init__(self):
        self.seen = []

    def check(self, engine, messages, response_text):
        self.seen.append((messages, response_text))
        flagged = "attack" in messages[-1]["content"] and not response_text.startswith("corrected:")
        return {"score": 9.0 if flagged else 0.1, "flagged": flagged}

    def correct(self, engine, messages, params):
        # through the server's engine view: a real regeneration in the running batcher
        return "corrected:" + str(len(engine.generate(["x"], params)[0][0].text) >= 0)


@pytest.mark.parametrize("action", ["annotate", "block", "correct"])
def test_guard_actions(action):
    guard = FakeGuard()
    server, _, _ = make_server(guard=guard, guard_action=action)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        calm = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, temperature=0)
        assert calm.choices[0].model_extra["guard"] == {"score": 0.1, "flagged": False, "action": "none"}
        assert guard.seen[-1] == (MSG, calm.choices[0].message.content)
        bad = [{"role": "user", "content": "attack now"}]
        for stream in (False, True):
            r = client.chat.completions.create(model="tiny", messages=bad, max_tokens=4, temperature=0, n=2,
                                               stream=stream)
            if stream:
                chunks = [c for c in r if c.choices]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == 0)
                last = [c for c in chunks if c.choices[0].index == 0][-1].choices[0]
                finish, verdict = last.finish_reason, last.model_extra["guard"]
            else:
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
                verdict = r.choices[0].model_extra["guard"]
            assert verdict["flagged"] is True and verdict["action"] == action
            if action == "block":
                assert finish == "content_filter" and "can't help" in text
            elif action == "correct":  # the server checked the correction (FakeGuard passes it)
                assert text == "corrected:True" and verdict["correction"]["outcome"] == "corrected"
            else:
                assert text == guard.seen[-1][1] or text in [s[1] for s in guard.seen]
        assert metric(server.url, "llmkit_guard_flagged_total", f'action="{action}"') == 4


def test_custom_kv_cache_factory_gives_same_answers():
    from transformers import DynamicCache

    made = []

    def factory(model):
        made.append(1)
        return DynamicCache(config=model.config)

    model, tok = tiny_llama(), tiny_tokenizer()
    plain = HFEngine(model, tok)
    server, _, _ = make_server(HFEngine(model, tok, cache_factory=factory))
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = [None, None]

        def call(i, p):
            out[i] = client.completions.create(model="tiny", prompt=p, max_tokens=5 + 10 * i, temperature=0)

        ts = [threading.Thread(target=call, args=(i, p)) for i, p in enumerate(["short", "a bit longer prompt"])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert made  # the server's batches used the factory's cache
    for i, p in enumerate(["short", "a bit longer prompt"]):
        assert out[i].choices[0].text == reference(plain, p, 5 + 10 * i).text


# -- the transformers engine's own decode loops -------------------------------------------------------------

PROMPTS = ["hi", "a longer prompt than that", "x" * 30, "the quick brown fox", "0123", "zz top", "hello there", "q"]


def plain_generate(model, tok, prompts, params, batch_size):
    from llmkit.generation import generate

    return generate(model, tok, prompts, params, batch_size=batch_size)


def model_with_early_eos():
    """The tiny model with a second EOS id it emits often, so rows of a batch end at different steps."""
    from collections import Counter

    model, tok = tiny_llama(), tiny_tokenizer()
    ref = plain_generate(model, tok, PROMPTS, GenerationParams(max_new_tokens=24), 8)
    common = Counter(t for c in ref for t in c.token_ids[1:12]).most_common(1)[0][0]
    model.generation_config.eos_token_id = [model.config.eos_token_id, common]
    return model, tok


def test_engine_greedy_equals_model_generate_with_rows_ending_early():
    model, tok = model_with_early_eos()
    params = GenerationParams(max_new_tokens=24)
    ref = plain_generate(model, tok, PROMPTS, params, 4)
    assert {c.finish_reason for c in ref} == {"stop", "length"}  # rows do end at different steps
    assert len({c.completion_tokens for c in ref}) >= 3
    got = [c[0] for c in HFEngine(model, tok, batch_size=4).generate(PROMPTS, params)]
    assert [(c.text, c.completion_tokens, c.finish_reason, c.token_ids, c.prompt_tokens) for c in got] == \
        [(c.text, c.completion_tokens, c.finish_reason, c.token_ids, c.prompt_tokens) for c in ref]


def test_engine_greedy_stop_strings_equal_model_generate(monkeypatch):
    import llmkit.engines.hf_batcher as hb

    model, tok = tiny_llama(), tiny_tokenizer()
    free = plain_generate(model, tok, PROMPTS, GenerationParams(max_new_tokens=30), 8)
    # stop strings taken from the answers: one short, one longer that starts earlier in another row
    stops = [free[0].text[6:8], free[1].text[3:9], "never-there"]
    params = GenerationParams(max_new_tokens=30, stop=stops)
    ref = plain_generate(model, tok, PROMPTS, params, 8)
    assert sum(c.finish_reason == "stop" for c in ref) >= 2
    steps = []
    real = hb.greedy_generate

    def counting(*a, **kw):
        out = real(*a, **kw)
        steps.append(max(len(ids) for ids, _ in out))
        return out

    monkeypatch.setattr(hb, "greedy_generate", counting)
    got = [c[0] for c in HFEngine(model, tok, batch_size=8).generate(PROMPTS, params)]
    assert [(c.text, c.completion_tokens, c.finish_reason, c.token_ids) for c in got] == \
        [(c.text, c.completion_tokens, c.finish_reason, c.token_ids) for c in ref]
    if all(c.finish_reason == "stop" for c in ref):  # every row stopped early: the loop ended before 30 steps
        assert steps[0] < 30


def test_engine_sampling_still_uses_generate_and_is_seeded():
    model, tok = tiny_llama(), tiny_tokenizer()
    eng = HFEngine(model, tok, batch_size=4)
    params = GenerationParams(max_new_tokens=10, temperature=1.0, seed=3)
    a = eng.generate(PROMPTS[:4], params)
    b = eng.generate(PROMPTS[:4], params)
    assert [c[0].text for c in a] == [c[0].text for c in b]
    assert a[0][0].text == plain_generate(model, tok, PROMPTS[:4], params, 4)[0].text


def _submit(loop, tok, prompt, max_tokens, results, name, on_token=None):
    from llmkit.engines.stream import StreamRequest

    parts = []

    def on_event(ev):
        parts.append(ev.text)
        if on_token is not None and not ev.finish_reason:
            on_token(ev.n_tokens)
        if ev.finish_reason:
            results[name] = ("".join(parts), ev.n_tokens, ev.finish_reason, ev.error)

    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    loop.submit(StreamRequest(ids, GenerationParams(max_new_tokens=max_tokens), on_event))


def test_requests_arriving_mid_batch_join_it_and_answers_do_not_change():
    model, tok = tiny_llama(), tiny_tokenizer()
    loop = HFEngine(model, tok).start_streaming(max_batch_size=8)
    results: dict = {}
    jobs = {"A": ("a long first prompt, wider than the others", 12), "B": ("hi", 30), "C": ("medium size", 30),
            "D": ("joins after A left", 8)}
    fired = set()

    def after(name, at, then):
        def hook(n):  # runs on the engine thread: the newcomers are queued before its next step
            if n >= at and name not in fired:
                fired.add(name)
                for other in then:
                    _submit(loop, tok, *jobs[other], results, other, on_token=hooks.get(other))
        return hook

    hooks = {"A": after("A", 3, ["B", "C"]), "B": after("B", 16, ["D"])}
    try:
        _submit(loop, tok, *jobs["A"], results, "A", on_token=hooks["A"])
        deadline = time.time() + 120
        while len(results) < 4 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        loop.stop()
    assert set(results) == {"A", "B", "C", "D"}
    assert loop.joined == 3  # B and C joined A's batch, D joined B and C after A had left
    assert loop.max_batch_seen == 3
    for name, (prompt, n) in jobs.items():
        ref = plain_generate(model, tok, [prompt], GenerationParams(max_new_tokens=n), 1)[0]
        assert results[name] == (ref.text, ref.completion_tokens, ref.finish_reason, None), name


@pytest.mark.bundled
@pytest.mark.slow
def test_bundled_engine_greedy_equals_model_generate_on_gsm8k(bundled, shared_data):
    import json

    model, tok = bundled
    eng = HFEngine(model, tok, batch_size=8)
    data = shared_data / "gsm8k" / "test.jsonl"
    qs = [json.loads(line)["question"] for line in data.read_text().splitlines()[:8]]
    prompts = [eng.chat_prompt([{"role": "user", "content": q}]) for q in qs]
    params = GenerationParams(max_new_tokens=48, stop=["\n\n"])
    ref = plain_generate(model, tok, prompts, params, 8)
    got = [c[0] for c in eng.generate(prompts, params)]
    assert [(c.text, c.completion_tokens, c.finish_reason) for c in got] == \
        [(c.text, c.completion_tokens, c.finish_reason) for c in ref]


def test_background_server_holds_its_port_from_choosing_it_to_serving():
    """Port 0: the port is bound from the moment it is chosen, so a parallel test's server cannot take it before
    uvicorn listens (it did, with a port chosen by binding and closing a socket), and the server answers on it."""
    import socket

    from fastapi import FastAPI

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    bg = BackgroundServer(app)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", bg.port))
    with bg:
        assert httpx.get(f"{bg.url}/ping", timeout=10).json() == {"ok": True}
