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
    assert main(["tune", "--param", "v", "--sphere", "3", "--method", "bisection", "--objective", f"{f}:vec"]) == 2


def test_tune_explicit_budget_is_honoured_in_1d(tmp_path):
    """--budget 40 (the bo/es default value) typed explicitly caps the 1-D search; without it there is no cap."""
    f = tmp_path / "obj.py"
    f.write_text(OBJ)
    base = ["tune", "--param", "alpha", "--range", "0,16", "--objective", f"{f}:quad", "--eps", "0.5",
            "--sigma", "0.2"]
    assert main(base + ["--out", str(tmp_path / "free")]) == 0
    free = json.loads((tmp_path / "free" / "result.json").read_text())
    assert free["evaluations"] > 40 and free["budget"] is None  # this search needs more than 40
    for b in ("40", "12"):
        out = tmp_path / f"cap{b}"
        assert main(base + ["--budget", b, "--out", str(out)]) == 0
        res = json.loads((out / "result.json").read_text())
        assert 0 < res["evaluations"] <= int(b) and res["budget"] == int(b)
        assert len((out / "evals.jsonl").read_text().splitlines()) == res["evaluations"]


def test_tune_bo_default_budget_still_40(tmp_path):
    f = tmp_path / "obj.py"
    f.write_text(OBJ)
    assert main(["tune", "--param", "a", "--range=-3,3", "--param", "b", "--range=-3,3", "--objective",
                 f"{f}:two", "--batch-size", "8", "--out", str(tmp_path / "bo")]) == 0
    res = json.loads((tmp_path / "bo" / "result.json").read_text())
    assert res["evaluations"] == 40 and res["budget"] == 40


@pytest.mark.parametrize("argv", [
    ["select", "--models", "a,b", "--delta", "1"],
    ["select", "--models", "a,b", "--beta", "1"],
    ["select", "--models", "a,b", "--delta", "0"],
    ["select", "--models", "a,b", "--beta", "1.5"],
    ["tune", "--param", "a", "--range", "0,1", "--objective", "m:f", "--delta", "1"],
    ["tune", "--param", "a", "--range", "0,1", "--objective", "m:f", "--delta", "0"],
    ["tune", "--param", "a", "--range", "0,1", "--objective", "m:f", "--sigma", "0"],
    ["tune", "--param", "a", "--range", "0,1", "--objective", "m:f", "--eps", "-1"],
])
def test_open_interval_flags_are_argparse_errors(argv, capsys):
    """delta / beta must lie in (0, 1) (TopTwoEBTCI, localize_minimizer): argparse says so, exit 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    flag = next(a for a in argv if a in ("--delta", "--beta", "--sigma", "--eps"))
    assert f"argument {flag}" in err and "Traceback" not in err


def test_open_unit_float():
    import argparse

    from llmkit.cli_types import open_unit_float

    assert open_unit_float("0.05") == 0.05 and open_unit_float("0.999") == 0.999
    for bad in ("0", "1", "1.0", "-0.1", "2", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            open_unit_float(bad)
