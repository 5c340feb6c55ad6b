"""The SMITH bench's library (``llmkit.experiments.smith``) and bench/smith.py's merge on fabricated parts and a tiny
"warm-started" model: the JSON carries use_fraction per GRPO step, the frozen student's keys with a parse rate, and
held-out macros with counts and binomial intervals. The bench's results folder is redirected; nothing under
bench/results is written."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import pytest

from llmkit.experiments import smith as ex
from llmkit.tools import ToolPool, sandbox, tasks


@pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
def test_merge_reports_use_fraction_student_and_intervals(tmp_path, repo_root, tiny_model, tiny_tokenizer,
                                                          monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_smith", repo_root / "bench" / "smith.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "results")
    # the quick preset with 2 questions per family and 8 new tokens: the frozen student's six evaluations on a
    # random model were most of this test's time, and the merge does the same with any sizes
    small = dataclasses.replace(ex.Preset.of(True), n=2, max_new=8)
    monkeypatch.setattr(ex.Preset, "of", staticmethod(lambda quick: small if quick else None))
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
    store = ex.parts_store(work, small)
    for name, d in (("base", base), ("warm", {"build_verified_rate_before": 0.0}), ("smith", run)):
        store.save(f"part_{name}", d)
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
        assert set(student[k]["n_per_family"].values()) == {small.n} and len(student[k]["macro_ci"]) == 2
        assert f"student_{k}" in res["conditions"]
    assert isinstance(student["reference_tools"]["call_parse_rate"], float)
    assert res["student_training_pool"]["families"] == ["lcm"]  # only GRPO's own verified tools
    assert res["heldout_stats"]["smith"]["macro_ci"] == [0.07, 0.52]
    assert set(res["parts_written_utc"]) == {"base", "warm", "smith"} and res["runs"]["smith"]["pool_size"] == 2
    assert (tmp_path / "results" / "smith_quick.png").is_file()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the last line is the summary
    assert last == ex.summary(res) and last["sandbox_escapes"] == 0 and last["heldout_macro_acc_combined_reward"] is None


def test_presets_and_parts_keyed_by_preset(tmp_path):
    quick, full = ex.Preset.of(True), ex.Preset.of(False)
    assert (quick.n, quick.grpo_steps, quick.warm_steps) == (4, 2, 20) and (full.n, full.grpo_steps) == (8, 12)
    ex.parts_store(tmp_path, quick).save("part_base", {"x": 1})
    with pytest.raises(FileNotFoundError, match=r"missing parts \['smith'\]"):
        ex.load_parts(ex.parts_store(tmp_path, quick))
    with pytest.raises(FileNotFoundError, match="'base', 'smith'"):  # a part made with another preset does not count
        ex.load_parts(ex.parts_store(tmp_path, full))
    ex.parts_store(tmp_path, quick).save("part_smith", {"y": 2})
    parts, written = ex.load_parts(ex.parts_store(tmp_path, quick))
    assert parts == {"base": {"x": 1}, "smith": {"y": 2}} and set(written) == {"base", "smith"}


def test_heldout_stats_and_reward_curves(tmp_path):
    r = {"macro": 0.5, "n_per_family": {"a": 2}, "correct_per_family": {"a": 1}, "macro_ci": [0.1, 0.9],
         "call_parse_rate": None, "sample_replies": {"a": "..."}}
    assert ex.heldout_stats(r) == {k: r[k] for k in ex.STAT_KEYS}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(x) for x in (
        {"step": 1, "rewards/schema_reward/mean": 0.5, "smith/pool_size": 9, "loss": 1.0},
        {"step": 2, "rewards/schema_reward/mean": 0.75, "smith/use_fraction": 0.5, "smith/pool_size": None})))
    curves = ex.reward_curves(metrics)
    assert curves == {"schema_reward": ([1, 2], [0.5, 0.75]), "pool_size": ([1], [9]), "use_fraction": ([2], [0.5])}
    assert ex.reward_curves(tmp_path / "absent.jsonl") == {}


def test_grpo_config_per_preset_and_arm(tmp_path):
    p = ex.Preset.of(True)
    smith = ex.grpo_config(tmp_path, p, "smith", "normalize_then_sum")
    combined = ex.grpo_config(tmp_path, p, "combined_reward", "combined")
    assert smith.max_steps == 2 and smith.num_prompts == 16 and smith.use_share == 0.5 and smith.eval_n == 4
    assert smith.eval_reference and not combined.eval_reference and not smith.eval_no_tools
    assert combined.reward_aggregation == "combined" and combined.output_dir == str(tmp_path / "combined_reward")


@pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
def test_sandbox_overhead_times_the_sandbox_against_a_plain_subprocess():
    ov = ex.sandbox_overhead(3)
    assert ov["n"] == 3 and 0 < ov["p50_ms"] <= ov["p95_ms"] and ov["anchor_p50_ms"] > 0
    assert ov["ratio"] == pytest.approx(ov["p50_ms"] / ov["anchor_p50_ms"])
    assert "anchor_p50_ms" not in ex.sandbox_overhead(1, unsafe_anchor=False)


@pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
def test_base_part_on_a_tiny_model(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    import llmkit.tools.attacks

    monkeypatch.setattr(llmkit.tools.attacks, "run_attacks", list)  # tests/tools/test_sandbox.py runs them
    tiny_model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    p = ex.Preset(quick=True, n=2, grpo_steps=1, warm_steps=1, max_new=8, build_max_new=8)
    store = ex.parts_store(tmp_path, p)
    d = store.save("part_base", ex.base_part(tmp_path, p, model_name=str(tmp_path / "m"), sandbox_calls=2))
    assert d["escapes"] == 0 and d["sandbox"]["n"] == 2
    assert set(d["conditions"]) == {"no_tools", "reference_tools", "untrained_writer"}
    for k, held in d["heldout_stats"].items():
        assert set(held) == set(ex.STAT_KEYS) and set(held["n_per_family"].values()) == {2}, k
    assert set(d["untrained_builds"]) == set(tasks.HELDOUT_FAMILIES) and 0 <= d["parse_base"] <= 1
    assert store.load("part_base") == json.loads(json.dumps(d))
