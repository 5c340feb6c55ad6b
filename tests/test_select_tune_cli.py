"""``llmkit select`` / ``llmkit tune``: selection loop, engine scoring, resumable tuning, user errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.cli import main


def test_select_best_picks_the_best_arm_with_fewer_evaluations():
    acc = np.array([0.6, 0.1, 0.05])
    table = np.random.default_rng(0).random((3, 300)) < acc[:, None]  # fixed outcome per (arm, problem)
    res = __import__("llmkit.selection", fromlist=["select_best"]).select_best(
        lambda a, i, *_: float(table[a, i]), 3, 300, delta=0.05, seed=0)
    assert res["stopped"] and res["winner"] == int(np.argmax(table.mean(1)))
    assert res["evaluations"] < 0.5 * res["full_evaluations"]
    lo, hi = res["arms"][0]["interval"]
    assert lo <= res["arms"][0]["estimate"] <= hi


class _FakeEngine:
    """Answers '#### 72' when the system prompt says so, else '#### 0'."""

    def chat_prompt(self, msgs):
        return json.dumps(msgs)

    def generate(self, prompts, params, n=1, progress=False):
        from llmkit.generation import Completion

        return [[Completion("#### 72" if "right" in p else "#### 0", 1, 1, "stop")] for p in prompts]

    def close(self):
        pass


def test_engine_scorer_grades_with_gsm8k(gsm8k_slice):
    from llmkit.evals import get_task
    from llmkit.selection import Arm, EngineScorer

    task = get_task("gsm8k")
    problems = task.load(str(gsm8k_slice))
    arms = [Arm("good", system_prompt="be right"), Arm("bad")]
    sc = EngineScorer(arms, problems, task, lambda m: _FakeEngine(), lookahead=2)
    assert sc.score(0, 0, [1]) == 1.0 and sc.score(1, 0) == 0.0 and sc.score(0, 1) == 0.0  # gold of #1 is 10
    assert len(sc.cache) == 3


def test_select_cli_user_errors(capsys, tmp_path):
    assert main(["select"]) == 2
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps([{"name": "a", "colour": 1}, {"name": "b"}]))
    assert main(["select", "--configs", str(bad)]) == 2
    assert "colour" in capsys.readouterr().err


OBJ = """
import numpy as np
CALLS = []
_rng = np.random.default_rng(0)
def quad(alpha):
    CALLS.append(alpha)
    return (alpha - 3.0) ** 2 + 0.05 * _rng.standard_normal()
def two(a, b):
    return (a - 1.0) ** 2 + (b + 2.0) ** 2
def vec(v):
    return float(-v[0])
"""


def test_tune_one_param_and_resume(tmp_path, capsys):
    f = tmp_path / "obj.py"
    f.write_text(OBJ)
    out = tmp_path / "run"
    argv = ["tune", "--param", "alpha", "--range", "0,16", "--objective", f"{f}:quad", "--eps", "0.25",
            "--sigma", "0.05", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads((out / "result.json").read_text())
    assert abs(res["best"]["alpha"] - 3.0) <= 0.25
    n = len((out / "evals.jsonl").read_text().splitlines())
    assert n == res["evaluations"] > 0
    assert main(argv) == 0  # resumed: every value replayed, the same answer
    res2 = json.loads((out / "result.json").read_text())
    assert res2["replayed"] == n and res2["best"] == res["best"]
    assert len((out / "evals.jsonl").read_text().splitlines()) == n


def test_tune_bo_and_sphere(tmp_path):
    f = tmp_path / "obj.py"
    f.write_text(OBJ)
    assert main(["tune", "--param", "a", "--range=-3,3", "--param", "b", "--range=-3,3", "--objective",
                 f"{f}:two", "--budget", "8", "--out", str(tmp_path / "bo")]) == 0
    res = json.loads((tmp_path / "bo" / "result.json").read_text())
    assert res["method"] == "bo" and res["evaluations"] == 8
    assert main(["tune", "--param", "v", "--sphere", "5", "--objective", f"{f}:vec", "--budget", "200",
                 "--out", str(tmp_path / "es")]) == 0
    res = json.loads((tmp_path / "es" / "result.json").read_text())
    assert res["method"] == "es" and res["best"]["v"][0] > 0.9


def test_tune_user_errors(tmp_path):
    assert main(["tune", "--param", "a", "--objective", "nosuchmod:f"]) == 2
    f = tmp_path / "obj.py"
    f.write_text(OBJ)
    assert main(["tune", "--param", "a", "--range", "5,1", "--objective", f"{f}:quad"]) == 2
