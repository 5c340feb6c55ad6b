"""ldp-proxy holds its trust boundary (issue 32, section 4): an allow-list upstream, a client key,
no silent default mechanism, and the cost and budget left on every answer."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from llmkit.serving.ldp_cache import (
    CacheStore,
    CandidateMechanism,
    ExponentialTokenMechanism,
    LDPCache,
    LDPScheduler,
    OpenAIUpstream,
    PrivacyLedger,
)
from llmkit.serving.ldp_cache.embedder import HashEmbedder
from llmkit.serving.ldp_cache.proxy import build_proxy_app

VOCAB = ["<unk>", "how", "many", "apples", "pears", "does", "tom", "have", "?", "be", "brief"]
BANK = ["how many apples does tom have ?", "what is the capital of france ?", "how tall is the eiffel tower ?",
        "who wrote hamlet ?"]
SECRET = "zz-my-secret-zz"
# request fields that carry no user text (imported lazily below, so each test fails alone on older code)
SAMPLING_PARAMS = ("max_tokens", "max_completion_tokens", "seed", "temperature", "top_p", "presence_penalty",
                   "frequency_penalty")


class FakeUpstream:
    """An OpenAI-compatible upstream in process (httpx transport) that records every body it gets."""

    def __init__(self, models=("stand-in",)):
        self.seen, self.models = [], list(models)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in self.models]})
        body = json.loads(request.content)
        self.seen.append(body)
        return httpx.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"reply {len(self.seen)}"},
                         "finish_reason": "stop"}]})

    def client(self) -> OpenAIUpstream:
        return OpenAIUpstream("http://upstream.test", transport=httpx.MockTransport(self))


def token_mech(eps=100.0):
    return ExponentialTokenMechanism.word_level(VOCAB, np.random.default_rng(0).normal(size=(len(VOCAB), 6)), eps)


def make_cache(up, tmp_path, budget=1e6, mechanism=None, assistant_turns="drop", rr=40.0):
    return LDPCache(up.client(), PrivacyLedger(tmp_path / "l.sqlite", budget), CacheStore(tmp_path / "c.sqlite"),
                    mechanism or token_mech(), HashEmbedder(), LDPScheduler(rr_epsilon=rr),
                    assistant_turns=assistant_turns)


def chat(c, messages, headers=None, **extra):
    return c.post("/v1/chat/completions", json={"model": "stand-in", "messages": messages, **extra},
                  headers=headers or {})


# --- only what the guarantee covers goes upstream ---

def test_only_roles_perturbed_content_and_sampling_numbers_reach_the_upstream(tmp_path):
    up = FakeUpstream()
    c = TestClient(build_proxy_app(make_cache(up, tmp_path, assistant_turns="perturb")))
    msgs = [{"role": "system", "content": "be brief", "name": SECRET + "-name"},
            {"role": "user", "content": "how many apples", "x_private": SECRET + "-extra"},
            {"role": "assistant", "content": "tom have apples",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "lookup", "arguments": json.dumps({"q": SECRET + "-args"})}}]},
            {"role": "tool", "tool_call_id": SECRET + "-id", "content": "tom have pears"},
            {"role": "user", "content": "how many pears ?"}]
    r = chat(c, msgs, max_tokens=5, temperature=0.5, seed=2, stop=[SECRET + "-stop"],
             tools=[{"type": "function", "function": {"name": "lookup", "description": SECRET + "-tool"}}],
             logit_bias={"42": 5}, metadata={"note": SECRET + "-meta"})
    assert r.status_code == 200, r.text
    (sent,) = up.seen
    assert SECRET not in json.dumps(sent)
    assert set(sent) <= {"model", "messages", *SAMPLING_PARAMS}
    assert (sent["max_tokens"], sent["temperature"], sent["seed"]) == (5, 0.5, 2)
    assert [set(m) for m in sent["messages"]] == [{"role", "content"}] * 5
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool", "user"]
    assert set(r.json()["ldp"]["dropped"]) == {
        "stop", "tools", "logit_bias", "metadata", "messages[].name", "messages[].x_private",
        "messages[].tool_calls", "messages[].tool_call_id"}


def test_the_library_refuses_fields_outside_the_allow_list_before_charging(tmp_path):
    up = FakeUpstream()
    cache = make_cache(up, tmp_path)
    for params, field in (({"stop": [SECRET]}, "stop"), ({"temperature": SECRET}, "temperature"),
                          ({"max_tokens": True}, "max_tokens"), ({"top_p": float("nan")}, "top_p")):
        with pytest.raises(ValueError, match=field):
            cache.ask_messages([{"role": "user", "content": "how many apples"}], params=params)
    assert up.seen == [] and cache.ledger.spent("default") == 0.0
    a = cache.ask_messages([{"role": "user", "content": "how many apples", "name": SECRET}])
    assert a.sent_messages == up.seen[0]["messages"] and SECRET not in json.dumps(up.seen[0])


@pytest.mark.parametrize("field,value", [("temperature", SECRET), ("max_tokens", "12"), ("seed", 1.5),
                                         ("model", SECRET)])
def test_a_text_smuggled_into_a_sampling_field_or_the_model_name_is_refused(tmp_path, field, value):
    up = FakeUpstream()
    c = TestClient(build_proxy_app(make_cache(up, tmp_path)))
    r = chat(c, [{"role": "user", "content": "how many apples"}], **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert not [b for b in up.seen if SECRET in json.dumps(b) or b.get(field) == value]


def test_help_says_what_is_sent_and_what_is_dropped(capsys):
    from llmkit.cli import main

    with pytest.raises(SystemExit):
        main(["ldp-proxy", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    sent, dropped = out.split("Never sent (dropped):")[0].split("Sent upstream:")[1], out.split("Never sent")[1]
    for k in SAMPLING_PARAMS:
        assert k in sent
    for k in ("'name'", "'tool_calls'", "'stop'", "any other message key"):
        assert k in dropped
    assert "--proxy-api-key" in out and "--question-bank" in out
    from llmkit.serving.ldp_cache.client import SAMPLING_PARAMS as allowed

    assert set(allowed) == set(SAMPLING_PARAMS)


# --- a client key ---

def test_without_the_proxy_key_nothing_is_spent_or_probed(tmp_path, monkeypatch):
    import hmac

    import openai

    from llmkit.serving.server import BackgroundServer

    up = FakeUpstream()
    cache = make_cache(up, tmp_path)
    app = build_proxy_app(cache, proxy_api_key="s3cret-key")
    c = TestClient(app)
    msgs = [{"role": "user", "content": "how many apples"}]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                    {"Authorization": "Basic s3cret-key"}):
        r = chat(c, msgs, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert c.get("/v1/ldp/budget", headers=headers).status_code == 401
        assert c.get("/v1/models", headers=headers).status_code == 401
    assert up.seen == [] and cache.ledger.spent("default") == 0.0
    assert c.get("/health").status_code == 200
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    ok = {"Authorization": "Bearer s3cret-key"}
    assert chat(c, msgs, headers=ok).status_code == 200 and calls  # the key is compared in constant time
    assert c.get("/v1/ldp/budget", headers=ok).json()["spent"] > 0
    with pytest.raises(ValueError, match="empty"):
        build_proxy_app(cache, proxy_api_key=" ")
    with BackgroundServer(app) as proxy:  # an unchanged OpenAI client sees the usual authentication error
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="stand-in", messages=msgs)
        good = openai.OpenAI(base_url=proxy.url + "/v1", api_key="s3cret-key", max_retries=0)
        assert good.chat.completions.create(model="stand-in", messages=msgs).choices[0].message.content


# --- the cost and the budget left on every answer ---

def test_every_answer_reports_its_epsilon_and_the_budget_left(tmp_path):
    up = FakeUpstream()
    # a miss costs 100 x 3 word pieces = 300; a hit costs the bit (40) but reserves the worst case (340)
    c = TestClient(build_proxy_app(make_cache(up, tmp_path, budget=740)))
    msgs = [{"role": "user", "content": "how many apples"}]
    for stream, eps, spent in ((False, 300.0, 300.0), (True, 40.0, 340.0)):
        r = chat(c, msgs, stream=stream)
        assert r.status_code == 200, r.text
        assert float(r.headers["X-LDP-Epsilon"]) == pytest.approx(eps)
        assert float(r.headers["X-LDP-Spent"]) == pytest.approx(spent)
        assert float(r.headers["X-LDP-Remaining"]) == pytest.approx(740.0 - spent)
        assert float(r.headers["X-LDP-Budget"]) == pytest.approx(740.0)
        if stream:
            ldp = json.loads([ln for ln in r.text.splitlines() if ln.startswith("data: {")][-1][6:])["ldp"]
        else:
            ldp = r.json()["ldp"]
        assert (ldp["epsilon"], ldp["remaining"], ldp["budget"]) == pytest.approx((eps, 740.0 - spent, 740.0))
    r = chat(c, [{"role": "user", "content": "how many pears ?"}])  # needs 4 x 100 + 40, 400 left: refused
    assert r.status_code == 429
    assert float(r.headers["X-LDP-Remaining"]) == pytest.approx(400.0)
    assert float(r.headers["X-LDP-Needed"]) == pytest.approx(440.0)


# --- a default a privacy engineer would accept ---

def test_the_sentence_mechanism_releases_a_whole_conversation_once(tmp_path):
    up = FakeUpstream()
    mech = CandidateMechanism(BANK, HashEmbedder(), epsilon=6.0)
    cache = make_cache(up, tmp_path, mechanism=mech, rr=2.0)
    a = cache.ask_messages([{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "how many apples does tom have ?"}], seed=0)
    assert a.epsilon == pytest.approx(6.0)  # one query, one release: not 6 per message
    (sent,) = up.seen
    assert [m["role"] for m in sent["messages"]] == ["user"] and sent["messages"][0]["content"] in BANK
    assert cache.worst_case_epsilon([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]) == \
        pytest.approx(6.0 + 2.0)


def test_opening_a_cache_needs_an_explicit_mechanism(tmp_path):
    with pytest.raises(ValueError, match="choose exactly one privacy mechanism"):
        LDPCache.open("http://upstream.test", 10.0, tmp_path, embedder=HashEmbedder())
    with pytest.raises(ValueError, match="choose exactly one privacy mechanism"):
        LDPCache.open("http://upstream.test", 10.0, tmp_path, embedder=HashEmbedder(), question_bank=BANK,
                      epsilon_per_token=1.0)
    cache = LDPCache.open("http://upstream.test", 10.0, tmp_path, embedder=HashEmbedder(), question_bank=BANK)
    assert isinstance(cache.mechanism, CandidateMechanism) and cache.mechanism.epsilon == 6.0


@pytest.fixture()
def no_server(monkeypatch):
    import uvicorn

    started = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.append(app))
    monkeypatch.delenv("LLMKIT_PROXY_API_KEY", raising=False)
    return started


def test_the_cli_refuses_to_start_without_a_privacy_setting(no_server, capsys, tmp_path):
    from llmkit.cli import main

    assert main(["ldp-proxy", "--upstream", "http://upstream.test", "--budget", "50",
                 "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--question-bank" in err and "--epsilon-per-token" in err and no_server == []
    bank = tmp_path / "bank.txt"
    bank.write_text("\n".join(BANK))
    assert main(["ldp-proxy", "--upstream", "http://upstream.test", "--budget", "50", "--question-bank",
                 str(bank), "--epsilon-per-token", "1", "--state-dir", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["ldp-proxy", "--upstream", "http://upstream.test", "--budget", "50", "--question-bank",
                 str(tmp_path / "missing.txt"), "--state-dir", str(tmp_path)]) == 2
    assert "missing.txt" in capsys.readouterr().err and no_server == []


def test_the_cli_says_what_the_sentence_setting_means_and_serves_it(no_server, capsys, tmp_path, monkeypatch):
    from llmkit.cli import main
    from llmkit.serving.ldp_cache import embedder

    monkeypatch.setattr(embedder, "MiniLMEmbedder", HashEmbedder)  # the real one loads a model
    monkeypatch.setenv("LLMKIT_PROXY_API_KEY", "env-key")
    bank = tmp_path / "bank.jsonl"
    bank.write_text("\n".join(json.dumps({"question": q}) for q in BANK) + "\n" + json.dumps(BANK[0]) + "\n")
    assert main(["ldp-proxy", "--upstream", "http://upstream.test", "--budget", "50", "--question-bank",
                 str(bank), "--state-dir", str(tmp_path / "state")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sentence-level mechanism over 4 public questions" in out and "epsilon 6 per query" in out
    p = np.exp(6) / (np.exp(6) + 3)
    assert f"probability {p:.2f}" in out and "Bearer" in out
    (app,) = no_server
    up = FakeUpstream()
    app.state.cache.upstream = up.client()
    c = TestClient(app)
    msgs = [{"role": "user", "content": "how many apples does tom have ?"}]
    assert chat(c, msgs).status_code == 401
    r = chat(c, msgs, headers={"Authorization": "Bearer env-key"})
    assert r.status_code == 200 and r.json()["ldp"]["epsilon"] == pytest.approx(6.0)
    assert up.seen[0]["messages"][0]["content"] in BANK


def test_the_startup_line_says_when_a_setting_means_little():
    from llmkit.commands.ldp_proxy import describe_privacy

    token = describe_privacy(token_mech(36.0), 3.0, 50.0)
    assert "a 20-piece query costs 720" in token and "no meaningful guarantee" in token
    big_bank = describe_privacy(CandidateMechanism([f"question {i}" for i in range(2000)], HashEmbedder(), 6.0),
                                3.0, 50.0)
    assert "under half the time" in big_bank and "about 5.56 cloud calls" in big_bank
