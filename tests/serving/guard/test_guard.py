"""AEO guard: capture, manifold, chaos score, threshold, save/load and refusal, correction, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from llmkit.serving.guard import Guard, Manifold, capture, split_conversation
from llmkit.serving.guard import score as S
from llmkit.serving.guard.correct import reasserted, steering
from llmkit.serving.guard.guard import _TF_MODELS, engine_model
from llmkit.testing import GUARD_SYSTEM as SYSTEM
from llmkit.testing import guard_compliant as compliant
from llmkit.testing import guard_conv as conv
from llmkit.testing import guard_violating as violating

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def fitted(tiny_model, tiny_tokenizer):
    return Guard.fit(tiny_model, tiny_tokenizer, compliant(30), model_name="tiny", layers=[1, 2],
                     n_components=8, target_fpr=0.1)


class StubEngine:
    """The parts of an llmkit engine the guard touches, over a given model (like the hf engine)."""

    name = "hf"

    def __init__(self, model, tok, model_name="tiny"):
        from llmkit.engines.hf import HFEngine

        self._hf = HFEngine(model, tok)
        self.model, self.tokenizer, self.model_name = model, tok, model_name
        self.prompts = []

    def chat_prompt(self, messages):
        return self._hf.chat_prompt(messages)

    def generate(self, prompts, params, n=1, progress=False):
        self.prompts += prompts
        return self._hf.generate(prompts, params, n=n)


# ---- capture ---------------------------------------------------------------------------------

def test_capture_takes_response_positions_and_is_batch_invariant(tiny_model, tiny_tokenizer):
    from llmkit.generation import chat_prompt

    convs = [conv("hi", "oui"), conv("a much longer question here", "bonjour merci beaucoup")]
    batched = capture(tiny_model, tiny_tokenizer, convs, [1, 2], with_logprobs=True, batch_size=2)
    single = [capture(tiny_model, tiny_tokenizer, [c], [1, 2], with_logprobs=True)[0] for c in convs]
    for c, b, s in zip(convs, batched, single):
        n_resp = len(tiny_tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"])
        assert b.n_tokens == n_resp and b.states[2].shape == (n_resp, 64)
        torch.testing.assert_close(b.states[2], s.states[2], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.token_logprobs, s.token_logprobs, atol=1e-4, rtol=1e-4)
    # the captured states are the model's own at the response positions
    c = convs[1]
    p_ids = tiny_tokenizer(chat_prompt(tiny_tokenizer, c[:-1]), add_special_tokens=False)["input_ids"]
    r_ids = tiny_tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = tiny_model(torch.tensor([p_ids + r_ids]), output_hidden_states=True)
    torch.testing.assert_close(batched[1].states[1], out.hidden_states[1][0, len(p_ids):], atol=1e-4, rtol=1e-4)
    logp = torch.log_softmax(out.logits[0, len(p_ids) - 1 : -1], -1).gather(1, torch.tensor(r_ids)[:, None])[:, 0]
    torch.testing.assert_close(batched[1].token_logprobs, logp, atol=1e-4, rtol=1e-4)


def test_captures_own_their_memory(tiny_model, tiny_tokenizer):
    # a capture kept for later (a benchmark keeps thousands) must not hold its batch's whole hidden states
    convs = [conv("hi", "oui"), conv("a much longer question here", "bonjour merci beaucoup")]
    for c in capture(tiny_model, tiny_tokenizer, convs, [1, 2], batch_size=2):
        for states in c.states.values():
            assert states.untyped_storage().nbytes() == states.numel() * states.element_size()


def test_capture_rejects_bad_input(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="assistant"):
        split_conversation([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="out of range"):
        capture(tiny_model, tiny_tokenizer, [conv("a", "b")], [7])
    empty = capture(tiny_model, tiny_tokenizer, [conv("a", "")], [2])[0]
    assert empty.n_tokens == 0 and empty.states[2].shape == (1, 64)  # the state that chose to stop


# ---- manifold and score -------------------------------------------------------------------------

def test_manifold_energy_is_mahalanobis_under_ppca_covariance():
    g = torch.Generator().manual_seed(0)
    d, k = 12, 3
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    x = (torch.randn(500, k, generator=g) * torch.tensor([5.0, 3.0, 2.0])) @ basis[:, :k].T
    x = x + 0.1 * torch.randn(500, d, generator=g) + 1.0
    m = Manifold.fit(x, n_components=k)
    cov = m.components.T.double() @ torch.diag(m.variances.double()) @ m.components.double() + float(m.noise) * (
        torch.eye(d, dtype=torch.float64) - m.components.T.double() @ m.components.double())
    y = torch.randn(5, d, generator=g) * 3
    diff = y.double() - m.mean.double()
    expect = (diff @ torch.linalg.inv(cov) * diff).sum(-1) / d
    torch.testing.assert_close(m.energy(y).double(), expect, rtol=1e-3, atol=1e-3)
    # off the subspace costs far more than the same distance along it
    along = m.mean + 3 * basis[:, 0]
    off = m.mean + 3 * basis[:, k]
    assert m.energy(off[None])[0] > 50 * m.energy(along[None])[0]


def test_threshold_at_fpr_bounds_the_compliant_flag_rate():
    s = torch.arange(100, dtype=torch.float64)
    for fpr in (0.01, 0.05, 0.2):
        t = S.threshold_at_fpr(s, fpr)
        assert (s > t).double().mean() <= fpr + 1e-12
        assert (s > t).double().mean() >= fpr - 0.011


# the chaos score's separation of an injected answer from a compliant one on the same task:
# tests/serving/guard/test_guard_context.py


# ---- save / load / refusal -------------------------------------------------------------------------

def test_save_load_roundtrip_and_refusals(fitted, tiny_model, tiny_tokenizer, tmp_path):
    fitted.save(tmp_path / "g")
    meta = json.loads((tmp_path / "g" / "guard.json").read_text())
    assert meta["model_name"] == "tiny" and meta["layers"] == [1, 2]
    loaded = Guard.load(tmp_path / "g", model_name="tiny")
    convs = compliant(4, seed=9) + violating(4)
    assert loaded.score(tiny_model, tiny_tokenizer, convs) == pytest.approx(
        fitted.score(tiny_model, tiny_tokenizer, convs), rel=1e-5)
    assert loaded.threshold == pytest.approx(fitted.threshold)
    with pytest.raises(ValueError, match=r"fitted on model 'tiny', not on 'other-model'"):
        Guard.load(tmp_path / "g", model_name="other-model")
    with pytest.raises(FileNotFoundError, match="not a guard folder"):
        Guard.load(tmp_path / "nothing")
    from llmkit.testing import tiny_llama

    wider = tiny_llama(hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 64"):
        loaded.score(wider, tiny_tokenizer, convs)


# ---- engine contract --------------------------------------------------------------------------------

def test_check_and_correct_through_engine(fitted, tiny_model, tiny_tokenizer, monkeypatch):
    from llmkit.generation import GenerationParams

    eng = StubEngine(tiny_model, tiny_tokenizer)
    good = conv("question", "bonjour merci oui")
    r_ok = fitted.check(eng, good[:-1], good[-1]["content"])
    r_bad = fitted.check(eng, good[:-1], "\u4e00\u4e01\u4e02\u4e03\u4e04")
    assert set(r_ok) >= {"score", "flagged"} and isinstance(r_ok["flagged"], bool)
    assert r_bad["flagged"] and r_bad["score"] > r_ok["score"]
    text = fitted.correct(eng, good[:-1], GenerationParams(max_new_tokens=4))
    assert isinstance(text, str)
    last = eng.prompts[-1]
    assert last.rindex("Reminder") > last.rindex("question")  # the instruction is re-asserted after the user turn
    # with the flagged original given, a correction that scores worse than it is not taken
    best = "bonjour merci oui"
    assert fitted.correct(eng, good[:-1], GenerationParams(max_new_tokens=4), original=best) == best

    # an engine without transformers weights (vLLM) gets one cached copy loaded by name
    class NoWeights:
        model_name = "tiny-by-name"
        tokenizer = tiny_tokenizer

    loads = []
    monkeypatch.setattr("llmkit.models.load", lambda name: loads.append(name) or (tiny_model, tiny_tokenizer))
    monkeypatch.delitem(_TF_MODELS, "tiny-by-name", raising=False)
    a = fitted.check(NoWeights(), good[:-1], "bonjour merci oui")
    b = fitted.check(NoWeights(), good[:-1], "bonjour merci oui")
    assert loads == ["tiny-by-name"] and a["score"] == pytest.approx(r_ok["score"]) == pytest.approx(b["score"])
    assert engine_model(NoWeights())[0] is tiny_model
    _TF_MODELS.pop("tiny-by-name", None)


def test_reassert_places_system_after_last_user(tiny_tokenizer):
    msgs = conv("do X instead", "")[:-1]
    out = reasserted(msgs, tiny_tokenizer, verbatim=True)
    assert out[-1]["role"] == "system" and SYSTEM in out[-1]["content"] and msgs[-1]["role"] == "user"
    generic = reasserted(msgs, tiny_tokenizer)
    assert generic[-1]["role"] == "system" and SYSTEM not in generic[-1]["content"]
    assert len(msgs) == 2  # the caller's list is untouched

    class FirstOnly:  # a template that rejects a later system message: fall back to the user turn
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("system only first")
            return "".join(m["content"] for m in messages)

    out = reasserted(msgs, FirstOnly(), verbatim=True)
    assert out[-1]["role"] == "user" and out[-1]["content"].startswith("do X instead") and SYSTEM in out[-1]["content"]


def test_steering_pulls_block_outputs_to_the_mean(fitted, tiny_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    man = fitted.manifolds[1]
    with torch.no_grad():
        plain = tiny_model(ids, output_hidden_states=True).hidden_states[1]
        with steering(tiny_model, {1: man}, alpha=1.0):
            pulled = tiny_model(ids, output_hidden_states=True).hidden_states[1]
        after = tiny_model(ids, output_hidden_states=True).hidden_states[1]
    torch.testing.assert_close(pulled[0], man.mean.expand(4, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, plain)  # hooks removed


# ---- CLI ------------------------------------------------------------------------------------------

def test_cli_fit_and_score(tiny_model, tiny_tokenizer, tmp_path, capsys):
    from llmkit.cli import main

    folder = tmp_path / "tiny-model"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"messages": c}) + "\n" for c in compliant(24)))
    assert main(["guard", "fit", "--model", str(folder), "--data", str(calib), "--out", str(tmp_path / "g"),
                 "--layers", "1,2", "--components", "4", "--target-fpr", "0.1"]) == 0
    assert "guard saved to" in capsys.readouterr().out
    inp = tmp_path / "in.jsonl"
    rows = [{"id": i, "messages": c} for i, c in enumerate(compliant(3, seed=7) + violating(3))]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["guard", "score", "--guard", str(tmp_path / "g"), "--input", str(inp),
                 "--output", str(tmp_path / "out.jsonl")]) == 0
    out = [json.loads(l) for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == list(range(6)) and all(isinstance(r["flagged"], bool) for r in out)
    assert min(r["score"] for r in out[3:]) > max(r["score"] for r in out[:3])
    # refusal against another model and bad data are one-line user errors
    assert main(["guard", "score", "--guard", str(tmp_path / "g"), "--input", str(inp),
                 "--model", "smollm2-135m-instruct"]) == 2
    assert "fitted on model" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": compliant(1)[0]}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "no response"}]}) + "\n")
    assert main(["guard", "score", "--guard", str(tmp_path / "g"), "--input", str(bad)]) == 2
    assert f"{bad}:2: the last message must be the assistant" in capsys.readouterr().err


@pytest.mark.bundled
def test_bundled_guard_alias_matches_engine_and_flags_gibberish(bundled):
    from llmkit.engines.hf import HFEngine
    from llmkit.models import DEFAULT_MODEL

    model, tok = bundled
    convs = [conv(f"Say hello number {i}.", f"Bonjour ! C'est le numéro {i}.") for i in range(16)]
    guard = Guard.fit(model, tok, convs, model_name=DEFAULT_MODEL, n_components=4, target_fpr=0.25)
    assert guard.layers[-1] == model.config.num_hidden_layers
    eng = HFEngine(model, tok)  # model_name is the cached folder: the alias must count as the same model
    from llmkit.serving.guard import same_model

    assert same_model(DEFAULT_MODEL, eng.model_name)
    ok = guard.check(eng, convs[0][:-1], "Bonjour ! C'est le numéro 3.")
    bad = guard.check(eng, convs[0][:-1], "def f(x):\n    return [i**2 for i in range(x)]  # SELECT * FROM")
    assert bad["score"] > ok["score"] and bad["flagged"]


def test_states_recorded_during_generation_match_teacher_forcing(fitted, tiny_model, tiny_tokenizer):
    from llmkit.generation import GenerationParams

    _letters_only(tiny_model, tiny_tokenizer)  # text round-trips to the same tokens
    eng = StubEngine(tiny_model, tiny_tokenizer)
    eng._hf.batch_size = eng.batch_size = 2
    prompts = [conv("hi", "")[:-1], conv("a longer question, padded less", "")[:-1], conv("third", "")[:-1]]
    out = fitted.generate(eng, prompts, GenerationParams(max_new_tokens=6))
    assert len(eng.prompts) == 3 and len(out) == 3  # one generation pass, no re-generation
    for (text, res), p in zip(out, prompts):
        tf = fitted.check(eng, p, text)
        n = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert res["n_tokens"] == n
        # same states, except that the last token of a length-cut response is never fed back
        assert res["score"] == pytest.approx(tf["score"], rel=0.35, abs=2.0)
    from llmkit.serving.guard.capture import GenerationRecorder

    with GenerationRecorder(tiny_model, [1, 2]) as rec:
        text = eng.chat_prompt(prompts[1])
        comps = [c[0] for c in eng._hf.generate([text], GenerationParams(max_new_tokens=5))]
    got = rec.captures(comps, [[tiny_tokenizer(text, add_special_tokens=False)["input_ids"]]])[0]
    convo = [*prompts[1], {"role": "assistant", "content": comps[0].text}]
    ref = capture(tiny_model, tiny_tokenizer, [convo], [1, 2])[0]
    k = got.states[2].shape[0]
    assert k == min(5, comps[0].completion_tokens) - (comps[0].finish_reason == "length")
    torch.testing.assert_close(got.states[1], ref.states[1][:k], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.states[2], ref.states[2][:k], atol=1e-4, rtol=1e-4)


def _letters_only(model, tok, scale=10.0):
    """Make a random model write ASCII letters only (one byte token each), so text round-trips to its tokens."""
    import string

    letters = [i for i, t in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))
               if t in set(string.ascii_letters)]
    with torch.no_grad():
        w = model.lm_head.weight
        keep = torch.zeros(w.shape[0], dtype=torch.bool)
        keep[letters] = True
        w[~keep] = 0
        w[keep] *= scale
    return letters


def test_generate_maps_recorded_states_to_rows_that_end_at_different_steps(tiny_tokenizer):
    """Batch > 1, rows ending at different steps: the hf greedy loop drops finished rows mid-batch.

    Guard.generate's per-response scores must equal the teacher-forced check_batch on the same texts
    (EOS-ended rows; a length-cut row lacks its last token's state, so it is compared with the
    teacher-forced states without that token), and with stop strings too.
    """
    from llmkit.generation import GenerationParams
    from llmkit.testing import tiny_llama

    model = tiny_llama(seed=1)  # seed 1 writes prompt-dependent letters (seed 0 repeats one pattern)
    letters = _letters_only(model, tiny_tokenizer)
    guard = Guard.fit(model, tiny_tokenizer, compliant(30), model_name="tiny", layers=[1, 2],
                      n_components=8, target_fpr=0.1)
    eng = StubEngine(model, tiny_tokenizer)
    eng._hf.batch_size = eng.batch_size = 8
    users = ["hi", "a longer question, padded less", "third", "what is the capital of France?", "zzz",
             "Tell me a story about dragons", "1+1=?", "ok"]
    prompts = [conv(u, "")[:-1] for u in users]
    max_new = 10
    free = [c[0] for c in eng._hf.generate([eng.chat_prompt(p) for p in prompts], GenerationParams(max_new_tokens=max_new))]

    # an extra EOS letter chosen so that rows end at as many different steps as possible (some never: length)
    def ends(x):
        return [c.token_ids.index(x) if x in c.token_ids else max_new for c in free]

    eos_letter = max(letters, key=lambda x: (len(set(ends(x))), -abs(ends(x).count(max_new) - 2)))
    assert len(set(ends(eos_letter))) >= 3 and max_new in ends(eos_letter)
    model.generation_config.eos_token_id = [tiny_tokenizer.eos_token_id, eos_letter]
    params = GenerationParams(max_new_tokens=max_new)

    passes = []  # teacher-forced passes run by the guard (the fallback when rows cannot be mapped)
    orig_capture = guard.capture
    guard.capture = lambda *a, **kw: passes.append(len(a[2])) or orig_capture(*a, **kw)

    eng.prompts.clear()
    out = guard.generate(eng, prompts, params)
    assert len(eng.prompts) == len(prompts) and passes == []  # one generation pass, states all recorded
    texts = [t for t, _ in out]
    assert [len(t) for t in texts] == ends(eos_letter)  # rows really ended at different steps
    ref = guard.check_batch(eng, prompts, texts)
    convs = [[*p, {"role": "assistant", "content": t}] for p, t in zip(prompts, texts)]
    caps = guard.capture(model, tiny_tokenizer, convs)
    for cap, t in zip(caps, texts):
        if len(t) == max_new:  # length-cut: the last token is never fed back, so it has no recorded state
            cap.states = {l: s[:-1] for l, s in cap.states.items()}
    cut_ref = guard.layer_z(caps)
    for i, ((text, res), r) in enumerate(zip(out, ref)):
        assert res["n_tokens"] == r["n_tokens"] == len(text)
        want = r["score"] if len(text) < max_new else float(cut_ref[i].mean())
        assert res["score"] == pytest.approx(want, rel=1e-3, abs=1e-3), (i, text)
        if len(text) < max_new:
            assert res["layer_scores"] == pytest.approx(r["layer_scores"], rel=1e-3, abs=1e-3)

    # stop strings: rows cut by a stop string at different steps; scores equal the teacher-forced ones
    model.generation_config.eos_token_id = tiny_tokenizer.eos_token_id
    stop = tiny_tokenizer.convert_ids_to_tokens(eos_letter)
    passes.clear()
    out = guard.generate(eng, prompts, GenerationParams(max_new_tokens=max_new, stop=[stop]))
    texts = [t for t, _ in out]
    assert len({len(t) for t in texts}) >= 3 and passes == [len(prompts)]  # stop rows: teacher-forced
    ref = guard.check_batch(eng, prompts, texts)
    for (text, res), r in zip(out, ref):
        assert res["n_tokens"] == r["n_tokens"]
        assert res["score"] == pytest.approx(r["score"], rel=1e-3, abs=1e-3), text

    # an engine that reorders the prompts of a call (here: reversed) is detected, not mis-assigned
    class Reversing(StubEngine):
        def generate(self, prompts, params, n=1, progress=False):
            return super().generate(prompts[::-1], params, n=n)[::-1]

    rev = Reversing(model, tiny_tokenizer)
    rev._hf.batch_size = rev.batch_size = 8
    passes.clear()
    out = guard.generate(rev, prompts, GenerationParams(max_new_tokens=4))  # no EOS: all rows full width
    texts = [t for t, _ in out]
    assert len(set(texts)) > 1 and passes == [len(prompts)]
    ref = guard.check_batch(eng, prompts, texts)
    for (text, res), r in zip(out, ref):
        assert res["score"] == pytest.approx(r["score"], rel=1e-3, abs=1e-3), text


# ---- cheaper server-path check: truncated pass, prompt prefilled beside generation ----------

def test_truncated_capture_equals_full_pass_and_skips_deeper_blocks(tiny_tokenizer):
    from llmkit.generation import chat_prompt
    from llmkit.testing import tiny_llama

    model = tiny_llama(num_layers=4)
    c = conv("a question", "bonjour merci beaucoup")
    calls = []
    hooks = [model.model.layers[i].register_forward_hook(lambda *a, i=i: calls.append(i)) for i in range(4)]
    hooks.append(model.lm_head.register_forward_hook(lambda *a: calls.append("head")))
    try:
        cap = capture(model, tiny_tokenizer, [c], [1, 2])[0]
        assert calls == [0, 1]  # blocks 3, 4, the final norm's consumers and the LM head never ran
        calls.clear()
        full_layers = capture(model, tiny_tokenizer, [c], [2, 4])[0]
        assert calls == [0, 1, 2, 3]
    finally:
        for h in hooks:
            h.remove()
    p_ids = tiny_tokenizer(chat_prompt(tiny_tokenizer, c[:-1]), add_special_tokens=False)["input_ids"]
    r_ids = tiny_tokenizer(c[-1]["content"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        hs = model.model(input_ids=torch.tensor([p_ids + r_ids]), output_hidden_states=True).hidden_states
    for l in (1, 2):
        assert torch.equal(cap.states[l], hs[l][0, len(p_ids):])  # same ops, same numbers
    assert torch.equal(full_layers.states[4], hs[4][0, len(p_ids):])  # the last layer keeps the final norm


def test_check_after_prefill_equals_whole_pass(fitted, tiny_model, tiny_tokenizer):
    engine = StubEngine(tiny_model, tiny_tokenizer)
    cases = compliant(3) + violating(2) + [conv("say nothing", "")]
    for c in cases:
        pre = fitted.prefill(engine, c[:-1])
        assert pre is not None and len(pre.ids) > 0
        whole = fitted.check(engine, c[:-1], c[-1]["content"])
        fast = fitted.check(engine, c[:-1], c[-1]["content"], prefill=pre)
        assert fast["n_tokens"] == whole["n_tokens"] and fast["flagged"] == whole["flagged"]
        assert fast["score"] == pytest.approx(whole["score"], rel=1e-4, abs=1e-4)
        # one prefill serves several choices: it is not consumed by a check
        again = fitted.check(engine, c[:-1], c[-1]["content"] + " encore", prefill=pre)
        ref = fitted.check(engine, c[:-1], c[-1]["content"] + " encore")
        assert again["score"] == pytest.approx(ref["score"], rel=1e-4, abs=1e-4)


def test_taps_ignore_other_threads(tiny_model, tiny_tokenizer):
    import importlib
    import threading

    cap_mod = importlib.import_module("llmkit.serving.guard.capture")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        ref = tiny_model(input_ids=ids).logits
    out = {}
    with cap_mod._Taps(tiny_model, [1]) as taps:  # stops after block 1, for this thread only
        t = threading.Thread(target=lambda: out.setdefault("logits", tiny_model(input_ids=ids).logits.detach()))
        t.start()
        t.join()
        assert taps.states == {}
        assert set(taps.run(input_ids=ids)) == {1}
    torch.testing.assert_close(out["logits"], ref)  # the other thread's forward ran to the end, untouched


def test_server_guard_uses_prefill_and_scores_like_the_whole_pass(fitted, tiny_model, tiny_tokenizer):
    import httpx

    from llmkit.engines.hf import HFEngine
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

    class Spy(Guard):
        pass

    spy = Spy(fitted.manifolds, fitted.center, fitted.scale, fitted.threshold, fitted.meta)
    seen = []
    orig = Guard.check

    def check(self, engine, messages, text, prefill=None):
        seen.append(prefill is not None)
        return orig(self, engine, messages, text, prefill=prefill)

    Spy.check = check
    engine = HFEngine(tiny_model, tiny_tokenizer)
    msgs = conv("bonjour", "")[:-1]
    for use_prefill in (True, False):
        seen.clear()
        app = build_app(engine, ServerConfig(model_name="tiny", max_model_len=256, guard=spy,
                                             guard_action="annotate", guard_prefill=use_prefill))
        with BackgroundServer(app) as server:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                           json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
        text, verdict = r["choices"][0]["message"]["content"], r["choices"][0]["guard"]
        assert seen == [use_prefill]
        whole = fitted.check(StubEngine(tiny_model, tiny_tokenizer), msgs, text)
        assert verdict["score"] == pytest.approx(whole["score"], rel=1e-4, abs=1e-4)
