"""ldp-proxy: OpenAI-compatible in front of a stand-in upstream (a tiny FastAPI app, no model)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llmkit.serving.ldp_cache import (
    CacheStore,
    ExponentialTokenMechanism,
    LDPCache,
    LDPScheduler,
    OpenAIUpstream,
    PrivacyLedger,
)
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.ldp_cache.proxy import build_proxy_app
from llmkit.serving.server import BackgroundServer

VOCAB = ["<unk>", "how", "many", "apples", "pears", "does", "tom", "have", "?", "be", "brief"]


def stand_in_upstream():
    app = FastAPI()
    app.state.seen = []

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        if body["model"] != "stand-in":
            return {"error": "wrong model"}
        app.state.seen.append(body)
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "stand-in",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"reply {len(app.state.seen)}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return app


@pytest.fixture()
def upstream():
    app = stand_in_upstream()
    with BackgroundServer(app) as s:
        yield s.url, app


def make_proxy(url, tmp_path, budget):
    mech = ExponentialTokenMechanism.word_level(VOCAB, np.random.default_rng(0).normal(size=(len(VOCAB), 6)),
                                                100.0)
    cache = LDPCache(OpenAIUpstream(url), PrivacyLedger(tmp_path / "l.sqlite", budget),
                     CacheStore(tmp_path / "c.sqlite", capacity=8), mech, HashEmbedder(),
                     LDPScheduler(rr_epsilon=40.0))
    return build_proxy_app(cache), cache


def ask(client, text, **extra):
    return client.post("/v1/chat/completions", json={"model": "stand-in", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": text}], **extra})


def test_proxy_caches_charges_and_refuses_openai_style(upstream, tmp_path):
    url, up_app = upstream
    # a miss costs 100 x (2 system + 7 user tokens) = 900 (+40 for the bit once the cache is non-empty)
    app, _ = make_proxy(url, tmp_path, budget=900 + 40 + 900)
    c = TestClient(app)
    r1 = ask(c, "how many apples does tom have?", max_tokens=7, seed=3)
    assert r1.status_code == 200, r1.text
    body = r1.json()
    assert body["choices"][0]["message"]["content"] == "reply 1"
    assert body["ldp"]["cache_hit"] is False and body["ldp"]["epsilon"] == pytest.approx(900)
    assert r1.headers["X-LDP-Cache"] == "miss"
    sent = up_app.state.seen[0]
    assert sent["max_tokens"] == 7 and sent["seed"] == 3  # request parameters pass through
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    r2 = ask(c, "how many apples does tom have?")
    assert r2.json()["ldp"]["cache_hit"] and r2.json()["choices"][0]["message"]["content"] == "reply 1"
    assert len(up_app.state.seen) == 1
    r3 = ask(c, "how many pears does tom have?")  # worst case 940 > remaining 900: refused
    assert r3.status_code == 429
    err = r3.json()["error"]
    assert err["type"] == "insufficient_quota" and err["code"] == "privacy_budget_exceeded"
    assert "privacy budget would be exceeded for user 'default'" in err["message"]
    assert len(up_app.state.seen) == 1
    b = c.get("/v1/ldp/budget").json()
    assert b["spent"] == pytest.approx(940) and b["spent"] <= b["budget"]


def test_proxy_rejects_malformed_requests(upstream, tmp_path):
    app, _ = make_proxy(upstream[0], tmp_path, budget=1e6)
    c = TestClient(app)
    assert c.post("/v1/chat/completions", content=b"{nope").status_code == 400
    r = c.post("/v1/chat/completions", json={"model": "stand-in", "messages": [{"role": "assistant", "content": "x"}]})
    assert r.status_code == 400 and "no user or system message" in r.json()["error"]["message"]
    assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2}
                  ).status_code == 400


def test_openai_client_works_unchanged_through_the_proxy(upstream, tmp_path):
    import openai

    app, _ = make_proxy(upstream[0], tmp_path, budget=1700)
    with BackgroundServer(app) as proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "how many apples does tom have?"}]
        a = client.chat.completions.create(model="stand-in", messages=msgs)
        b = client.chat.completions.create(model="stand-in", messages=msgs)
        assert a.choices[0].message.content == b.choices[0].message.content == "reply 1"
        stream = client.chat.completions.create(model="stand-in", messages=msgs, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == "reply 1"
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="stand-in", messages=[
                {"role": "user", "content": "how many pears does tom have? how many apples?"}])
        assert e.value.code == "privacy_budget_exceeded"
        assert [m.id for m in client.models.list().data] == ["stand-in"]


def test_cli_rejects_a_bad_upstream(capsys):
    from llmkit.cli import main

    assert main(["ldp-proxy", "--upstream", "localhost:8000", "--budget", "10"]) == 2
    assert "--upstream must be an http(s) URL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["ldp-proxy", "--upstream", "http://x", "--budget", "-1"])
    assert e.value.code == 2
