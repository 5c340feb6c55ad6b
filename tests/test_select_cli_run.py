"""``llmkit select`` end to end with a fake engine: the winner, evaluations below a full run, the saved JSON,
one engine per (model, KV-cache settings), and guard settings applied to an arm's answers."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import main

N_PROBLEMS = 40


class _FakeEngine:
    """Answers '#### 72' when the prompt (system prompt included) says 'right', else '#### 0'."""

    def __init__(self, model, kw):
        self.model_name, self.kw, self.prompts = model, kw, 0

    def chat_prompt(self, msgs):
        return json.dumps(msgs)

    def generate(self, prompts, params, n=1, progress=False):
        from llmkit.generation import Completion

        self.prompts += len(prompts)
        return [[Completion("#### 72" if "right" in p else "#### 0", 1, 1, "stop")] for p in prompts]

    def close(self):
        pass


@pytest.fixture
def questions(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps({"question": f"Problem {k}: what is 70 plus 2?", "answer": "#### 72"}) + "\n"
                         for k in range(N_PROBLEMS)))
    return p


@pytest.fixture
def engines(monkeypatch):
    built = []

    def fake_get_engine(name, model=None, **kw):
        built.append(_FakeEngine(model, {"engine": name, **kw}))
        return built[-1]

    monkeypatch.setattr("llmkit.engines.get_engine", fake_get_engine)
    return built


def test_select_cli_picks_the_clearly_best_config(tmp_path, questions, engines, capsys):
    cfg = tmp_path / "arms.json"
    cfg.write_text(json.dumps([
        {"name": "plain", "max_new_tokens": 16},
        {"name": "right", "system_prompt": "Be right.", "max_new_tokens": 16},
        {"name": "plain-inquant", "kv_cache": "inquant", "kv_cache_options": {"group_size": 64}},
    ]))
    out = tmp_path / "res" / "select.json"
    assert main(["select", "--configs", str(cfg), "--data", str(questions), "--model", "m0",
                 "--delta", "0.05", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "winner: right\n" in printed and "not separated" not in printed
    res = json.loads(out.read_text())
    assert res["winner"] == 1 and res["stopped"] and res["arm_names"] == ["plain", "right", "plain-inquant"]
    full = 3 * N_PROBLEMS
    assert res["full_evaluations"] == full and 0 < res["evaluations"] < full
    assert f"evaluations: {res['evaluations']} of {full}" in printed
    assert res["evaluations"] == sum(e.prompts for e in engines)  # every generation counted as spent
    assert res["arms"][1]["estimate"] == 1.0 and res["arms"][0]["estimate"] == 0.0
    # one engine per (model, KV-cache settings): "plain" and "right" share one, the InQuant arm has its own
    assert res["engines_built"] == len(engines) == 2
    by_cache = {e.kw.get("cache_factory") is not None: e for e in engines}
    assert set(by_cache) == {False, True} and all(e.model_name == "m0" for e in engines)
    assert res["arm_settings"][2]["kv_cache"] == "inquant"


def test_select_cli_models_mode(tmp_path, questions, monkeypatch, capsys):
    """--models: one engine per model; the model named 'right-ckpt' answers right (its name is in the prompt)."""

    class _ByModel(_FakeEngine):
        def chat_prompt(self, msgs):
            return json.dumps(msgs) + self.model_name

    monkeypatch.setattr("llmkit.engines.get_engine", lambda name, model=None, **kw: _ByModel(model, kw))
    out = tmp_path / "m.json"
    assert main(["select", "--models", "a-ckpt,right-ckpt", "--data", str(questions), "--batch-size", "4",
                 "--output", str(out)]) == 0
    assert "winner: right-ckpt" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["winner"] == 1 and res["evaluations"] < res["full_evaluations"] == 2 * N_PROBLEMS


class _FakeGuard:
    """Flags every answer (score 1.0 over threshold 0.5); a correction answers '#### 72'."""

    threshold = 0.5

    def generate(self, engine, msgs_list, params):
        texts = [c[0].text for c in engine.generate([engine.chat_prompt(m) for m in msgs_list], params)]
        return [(t, {"score": 1.0, "flagged": True, "threshold": 0.5}) for t in texts]

    def correct_batch(self, engine, msgs_list, params, **kw):
        return ["#### 72"] * len(msgs_list)


def test_select_cli_guard_settings(tmp_path, questions, engines, monkeypatch, capsys):
    from llmkit.models import DEFAULT_MODEL
    from llmkit.serving.guard import Guard

    loads = []

    def fake_load(cls, directory, model_name=None):
        loads.append((directory, model_name))
        return _FakeGuard()

    monkeypatch.setattr(Guard, "load", classmethod(fake_load))
    cfg = tmp_path / "arms.yaml"
    cfg.write_text("right-blocked: {system_prompt: Be right., guard: g1, guard_action: block}\n"
                   "right-open: {system_prompt: 'Be right, please.'}\n"
                   "plain-corrected: {guard: g1, guard_action: correct}\n"
                   "plain-annotated: {guard: g1, guard_threshold: 2.0}\n")
    out = tmp_path / "g.json"
    assert main(["select", "--configs", str(cfg), "--data", str(questions), "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    est = {n: a["estimate"] for n, a in zip(res["arm_names"], res["arms"])}
    # block: every flagged answer graded as the refusal; correct: the regenerated answer is graded
    assert est["right-blocked"] == 0.0 and est["right-open"] == 1.0 and est["plain-corrected"] == 1.0
    assert res["arm_names"][res["winner"]] in ("right-open", "plain-corrected")
    assert res["arms"][0]["guard_flagged"] > 0 and "guard_flagged" not in res["arms"][1]
    # threshold 2.0 over score 1.0: nothing flagged, the answer kept (scores 0)
    assert res["arms"][3]["pulls"] > 0 and res["arms"][3]["guard_flagged"] == 0 and est["plain-annotated"] == 0.0
    assert loads == [("g1", DEFAULT_MODEL)]  # checked against the arm's model (here the default); loaded once
    assert res["engines_built"] == 1  # guards do not change the engine
    assert "guard flagged" in capsys.readouterr().out


def test_select_cli_engine_and_guard_errors(tmp_path, questions, engines, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps([{"name": "a", "kv_cache": "inquant"}, {"name": "b"}]))
    assert main(["select", "--configs", str(cfg), "--data", str(questions), "--engine", "vllm"]) == 2
    assert "kv_cache works only with --engine hf" in capsys.readouterr().err
    cfg.write_text(json.dumps([{"name": "a", "guard": str(tmp_path / "no-guard")}, {"name": "b"}]))
    assert main(["select", "--configs", str(cfg), "--data", str(questions), "--output", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "guard" in err and "no-guard" in err and not engines  # failed before any engine was built
