"""``llmkit.selection`` arm settings: KV-cache / guard keys validated, engines keyed by engine settings,
guard actions applied offline, and TableScorer's lookahead accounting (what bench/select.py replays)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.selection import Arm, EngineScorer, TableScorer, arms_from_config, select_best


def test_arm_keys_accept_kv_cache_and_guard_settings():
    arms = arms_from_config({
        "q": {"kv_cache": "inquant", "kv_cache_options": {"group_size": 64, "n_outliers": 2, "min_ratio": 0}},
        "k": {"kv_cache": "KIVI"},
        "d": {"kv_cache": "none"},
        "g": {"guard": "gdir", "guard_action": "correct", "guard_threshold": 1.5},
    })
    assert arms[0].engine_settings() == {"kv_cache": "inquant",
                                         "kv_cache_options": {"group_size": 64, "n_outliers": 2, "min_ratio": 0}}
    assert arms[1].engine_settings() == {"kv_cache": "kivi", "kv_cache_options": {}}
    assert arms[2].engine_settings() == {} and arms[3].engine_settings() == {}
    assert arms[2].engine_key() == arms[3].engine_key() == (None, None, ())
    assert arms[3].guard == "gdir" and arms[3].guard_action == "correct" and arms[3].guard_threshold == 1.5


@pytest.mark.parametrize("item, words", [
    ({"colour": 1}, ["colour"]),
    ({"kv_cache": "zip"}, ["kv_cache", "zip"]),
    ({"kv_cache": "inquant", "kv_cache_options": {"bits": 3}}, ["bits", "group_size"]),
    ({"kv_cache_options": {"group_size": 64}}, ["without kv_cache"]),
    ({"kv_cache": "none", "kv_cache_options": {"group_size": 64}}, ["default cache"]),
    ({"guard_action": "block"}, ["guard_action", "without guard"]),
    ({"guard": "g", "guard_action": "drop"}, ["drop", "annotate"]),
    ({"guard": "g", "guard_threshold": "high"}, ["guard_threshold"]),
])
def test_arm_config_errors_name_the_key(item, words):
    with pytest.raises((ValueError, TypeError)) as e:
        arms_from_config([{"name": "a", **item}, {"name": "b"}])
    assert all(w in str(e.value) for w in words), str(e.value)


class _Eng:
    def __init__(self, kw):
        self.kw = kw

    def chat_prompt(self, msgs):
        return json.dumps(msgs)

    def generate(self, prompts, params, n=1, progress=False):
        from llmkit.generation import Completion

        return [[Completion("#### 72" if "right" in p else "#### 0", 1, 1, "stop")] for p in prompts]

    def close(self):
        pass


def test_one_engine_per_model_and_kv_cache_settings(gsm8k_slice):
    from llmkit.evals import get_task

    task = get_task("gsm8k")
    problems = task.load(str(gsm8k_slice))
    arms = [Arm("a", model="m"), Arm("b", model="m", system_prompt="be right"),
            Arm("c", model="m", kv_cache="inquant"), Arm("d", model="m", kv_cache="inquant"),
            Arm("e", model="m", kv_cache="inquant", kv_cache_options={"group_size": 64}), Arm("f", model="n")]
    calls = []

    def factory(model, **kw):
        calls.append((model, kw))
        return _Eng(kw)

    sc = EngineScorer(arms, problems, task, factory)
    for a in range(len(arms)):
        sc.score(a, 0)
    assert calls == [("m", {}), ("m", {"kv_cache": "inquant", "kv_cache_options": {}}),
                     ("m", {"kv_cache": "inquant", "kv_cache_options": {"group_size": 64}}), ("n", {})]
    assert sc.score(1, 0) == 1.0 and sc.score(0, 0) == 0.0


class _Guard:
    def __init__(self, score):
        self.score = score

    def generate(self, engine, msgs_list, params):
        texts = [c[0].text for c in engine.generate([engine.chat_prompt(m) for m in msgs_list], params)]
        return [(t, {"score": self.score, "flagged": self.score > 1.0}) for t in texts]

    def correct_batch(self, engine, msgs_list, params, **kw):
        assert all(m[0]["role"] == "user" or m[0]["role"] == "system" for m in msgs_list)
        return ["#### 72"] * len(msgs_list)


@pytest.mark.parametrize("action, threshold, score, good_arm_score, bad_arm_score, flagged", [
    ("annotate", None, 5.0, 1.0, 0.0, 2),  # flagged, counted, graded unchanged
    ("block", None, 5.0, 0.0, 0.0, 2),     # flagged answers graded as the refusal
    ("correct", None, 5.0, 1.0, 1.0, 2),   # flagged answers replaced by the correction
    ("block", 9.0, 5.0, 1.0, 0.0, 0),      # threshold override: under it nothing is flagged
    ("correct", 0.5, 0.7, 1.0, 1.0, 2),    # ... and over it (the fitted threshold 1.0 would not flag)
])
def test_guard_actions_offline(gsm8k_slice, action, threshold, score, good_arm_score, bad_arm_score, flagged):
    from llmkit.evals import get_task

    task = get_task("gsm8k")
    problems = task.load(str(gsm8k_slice))[:1]  # gold 72
    g = {"guard": "gdir", "guard_action": action, "guard_threshold": threshold}
    arms = [Arm("good", system_prompt="be right", **g), Arm("bad", **g)]
    loaded = []
    sc = EngineScorer(arms, problems, task, lambda m, **kw: _Eng(kw),
                      guard_loader=lambda path, model: loaded.append((path, model)) or _Guard(score))
    assert sc.score(0, 0) == good_arm_score and sc.score(1, 0) == bad_arm_score
    assert sum(sc.guard_flagged) == flagged and loaded == [("gdir", None)]  # one load per (folder, model)


def test_table_scorer_counts_lookahead_like_the_cli():
    acc = np.array([0.6, 0.1, 0.05])
    table = np.random.default_rng(0).random((3, 200)) < acc[:, None]
    sc = TableScorer(table, lookahead=8)
    assert sc.score(0, 5, [5, 6, 7]) == float(table[0, 5]) and len(sc.cache) == 3
    assert sc.score(0, 6) == float(table[0, 6]) and len(sc.cache) == 3  # already generated in that batch
    sc = TableScorer(table, lookahead=8)
    res = select_best(sc.score, 3, 200, delta=0.05, seed=0, generated=lambda: len(sc.cache))
    bare = select_best(lambda a, i, *_: float(table[a, i]), 3, 200, delta=0.05, seed=0)
    assert res["winner"] == bare["winner"] == 0 and res["pulls"] == bare["pulls"]  # same draws, same decision
    assert bare["evaluations"] <= res["evaluations"] == len(sc.cache) < res["full_evaluations"]
