"""bench/smith.py's merge on fabricated parts and a tiny "warm-started" model: the JSON carries use_fraction per
GRPO step, the frozen student's keys with a parse rate, and held-out macros with counts and binomial intervals.
The bench's results folder is redirected; nothing under bench/results is written."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from llmkit.tools import ToolPool, sandbox, tasks


@pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
def test_merge_reports_use_fraction_student_and_intervals(tmp_path, repo_root, tiny_model, tiny_tokenizer,
                                                          monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_smith", repo_root / "bench" / "smith.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "results")
    work = tmp_path / "work" / "quick"
    (work / "warm").mkdir(parents=True)
    tiny_model.save_pretrained(work / "warm" / "model")
    tiny_tokenizer.save_pretrained(work / "warm" / "model")
    fams = list(tasks.HELDOUT_FAMILIES)
    held = {"macro": 0.25, "n_per_family": dict.fromkeys(fams, 4),
            "correct_per_family": {f: int(i == 0) * 4 for i, f in enumerate(fams)}, "macro_ci": [0.07, 0.52],
            "call_parse_rate": None}
    cond = {"no_tools": 0.0, "reference_tools": 0.0, "untrained_writer": 0.0}
    base = {"sandbox": {"p50_ms": 100.0, "p95_ms": 120.0, "anchor_p50_ms": 90.0, "ratio": 1.1}, "attacks": {},
            "escapes": 0, "conditions": cond, "per_family": {k: dict.fromkeys(fams, 0.0) for k in cond},
            "parse_base": 0.0, "sample_replies": {}, "untrained_builds": {}, "heldout_stats": dict.fromkeys(cond, held)}
    run = {"macro": 0.25, "per_family": dict.fromkeys(fams, 0.25), "heldout_stats": held, "use_fraction": [0.5, 0.5],
           "seeded_pool": {"from": "reference", "families": {"gcd": True}}, "reference_macro": None, "parse": None,
           "sample_replies": {}, "reference_sample_replies": None,
           "run": {"seconds": 1.0, "pool_size": 2, "pool_growth": [], "heldout_builds": {},
                   "policy_no_tools_macro": None, "curves": {"use_fraction": [[1, 2], [0.5, 0.5]]}}}
    for name, d in (("base", base), ("warm", {"build_verified_rate_before": 0.0}), ("smith", run)):
        (work / f"part_{name}.json").write_text(json.dumps(d))
    heldout_fam = tasks.get(fams[0])
    ToolPool(work / "smith" / "eval_pool_after").add(heldout_fam.reference, heldout_fam.name, 1.0, source="policy")
    train_pool = ToolPool(work / "smith" / "pool")
    train_pool.add(tasks.get("gcd").reference, "gcd", 1.0, source="warm_start")  # a seed: not the policy's
    train_pool.add(tasks.get("lcm").reference, "lcm", 1.0, step=1, source="policy")
    monkeypatch.setattr(sys, "argv", ["smith.py", "--quick", "--only", "merge", "--work", str(tmp_path / "work")])
    assert bench.main() == 0
    res = json.loads((tmp_path / "results" / "smith_quick.json").read_text())
    assert res["use_fraction"] == {"smith": [0.5, 0.5]}
    student = res["student"]
    assert student["smith_heldout_tools"] == [fams[0]] and "before GRPO" in student["model"]
    for k in ("smith_tools", "untrained_tools", "reference_tools", "no_tools"):
        assert set(student[k]["n_per_family"].values()) == {4} and len(student[k]["macro_ci"]) == 2
        assert f"student_{k}" in res["conditions"]
    assert isinstance(student["reference_tools"]["call_parse_rate"], float)
    assert res["student_training_pool"]["families"] == ["lcm"]  # only GRPO's own verified tools
    assert res["heldout_stats"]["smith"]["macro_ci"] == [0.07, 0.52]
