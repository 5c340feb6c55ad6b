"""VSPO's experiments: pooled rates with Wilson intervals over seeds, censored first steps, the bandit simulation,
the alignment pick's effect on the runs, resumable split runs, the figures and the two thin benches."""

from __future__ import annotations

import importlib.util
import json
import random

import numpy as np
import pytest

from llmkit.experiments import vspo as ex
from llmkit.experiments.stats import wilson


def _run(rate, acc, n=20, first=None):
    return {"after": {"n": n, "behavior_rate": rate, "accuracy": acc, "mean_words": 30.0},
            "first_step_at_target": first}


def _bench(repo_root, name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", repo_root / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- statistics over seeds -----------------------------------------------------------------------------------

def test_wilson_matches_the_textbook_interval():
    lo, hi = wilson(5, 20)
    assert lo == pytest.approx(0.1119, abs=1e-3) and hi == pytest.approx(0.4691, abs=1e-3)
    lo, hi = wilson(0, 24)
    assert lo == 0.0 and 0.1 < hi < 0.16  # a zero count still has a real upper bound
    with pytest.raises(ValueError):
        wilson(3, 0)
    with pytest.raises(ValueError):
        wilson(5, 4)


def test_pooled_counts_problems_over_seeds():
    p = ex.pooled([_run(0.5, 0.1)["after"], _run(0.25, 0.2)["after"]], "behavior_rate")
    assert p["k"] == 15 and p["n"] == 40 and p["rate"] == pytest.approx(0.375)
    assert p["per_seed"] == [0.5, 0.25] and p["seed_sd"] == pytest.approx(0.1767767)
    assert p["ci95"] == pytest.approx(list(wilson(15, 40)))
    with pytest.raises(ValueError, match="no evaluations"):
        ex.pooled([], "accuracy")


def test_first_steps_keep_censored_seeds_censored():
    fs = ex.first_steps([_run(0.5, 0, first=4), _run(0.5, 0, first=None), _run(0.5, 0, first=8)], max_steps=16)
    assert fs["reached"] == 2 and fs["per_seed"] == [4, None, 8] and fs["km_median"] == pytest.approx(8.0)
    fs = ex.first_steps([_run(0.1, 0), _run(0.1, 0, first=2), _run(0.1, 0)], max_steps=16)
    assert fs["km_median"] is None and fs["mean_reached"] == 2  # 1 of 3: the median is not reached


def test_summarize_methods_skips_methods_without_evaluations():
    s = ex.summarize_methods({"vspo": [_run(0.5, 0.1, first=2)], "grpo": [{"steps": 2}]}, max_steps=4)
    assert set(s) == {"vspo"} and s["vspo"]["seeds"] == 1 and s["vspo"]["behavior_rate"]["seed_sd"] is None


def test_km_median_treats_censored_runs_as_at_least_the_cap():
    # 3 of 5 reach (10, 20, 30), 2 censored at 100: the KM median is 30, not a value pulled to the cap
    assert ex.km_median([10, 20, 30, None, None], 100) == pytest.approx(30.0)
    # 2 of 5 reach: survival never falls to 0.5, so the median is not reached (counting the cap would say 100)
    assert ex.km_median([10, 20, None, None, None], 100) is None
    assert ex.km_median([None, None], 100) is None
    assert ex.km_median([4, 6, 8], 100) == pytest.approx(6.0)


# --- bandit abstraction --------------------------------------------------------------------------------------

def test_problem_puts_target_at_p0():
    cfg = ex.BanditConfig(p0=0.01)
    theta, reward, _b, target = ex.make_problem(np.random.default_rng(0), cfg)
    assert ex.softmax(theta)[target].sum() == pytest.approx(0.01)
    assert target.sum() == cfg.behavior_arms and (reward[target] == 2).all()


def test_alpha_schedules():
    cfg = ex.BanditConfig(alpha_max=4.0, anneal=10)
    assert ex.alpha_top("vspo_aligned", 5, cfg) == pytest.approx(2.0) and ex.alpha_top("vspo_aligned", 20, cfg) == 0.0
    assert ex.alpha_top("vspo_aligned_fixed", 20, cfg) == 4.0 and ex.alpha_top("reward_shaping", 0, cfg) == 0.0


def test_aligned_steering_reaches_target_where_shaping_is_censored():
    cfg = ex.BanditConfig(p0=0.002, max_iters=150)
    shaping = [ex.run_bandit("reward_shaping", s, cfg)[0] for s in range(3)]
    aligned = [ex.run_bandit("vspo_aligned", s, cfg)[0] for s in range(3)]
    assert shaping == [None, None, None]  # the cap is not a hitting time
    assert all(t is not None and t < 150 for t in aligned)
    sh, al = ex.summarize_times(shaping, 150), ex.summarize_times(aligned, 150)
    assert sh["km_median_iters"] is None and sh["censored"] == 3
    ratio, kind = ex.speedup(sh, al)
    assert kind == "lower_bound" and ratio == pytest.approx(150 / al["km_median_iters"])
    assert ex.speedup(al, sh) == (None, "undefined")


def test_unknown_method_and_bad_config():
    with pytest.raises(ValueError, match="unknown method"):
        ex.run_bandit("ppo", 0, ex.BanditConfig(max_iters=2))
    with pytest.raises(ValueError, match="p0"):
        ex.BanditConfig(p0=1.5)


def test_bandit_runs_and_figures_cover_every_method_p0_and_anneal_length():
    base = {"max_iters": 30, "anneal": 10}
    times, curves = ex.bandit_runs(base, [0.05, 0.01], [3], seeds=2, progress=False)
    assert set(times) == {f"{m}_p0_{p}" for m in ex.BANDIT_METHODS for p in ("0.05", "0.01")} | {
        "vspo_aligned_anneal3_p0_0.05", "vspo_aligned_anneal3_p0_0.01"}
    assert all(len(v) == 2 and len(curves[k]) == 2 for k, v in times.items())
    summary = {k: ex.summarize_times(v, 30) for k, v in times.items()}
    fig = ex.bandit_figures(summary, [0.05, 0.01], 30, 10, [3])
    assert fig["reward_shaping_p0_0.05_reached"].endswith("/2")
    for p in ("0.05", "0.01"):
        for key in (f"speedup_aligned_vs_shaping_p0_{p}", f"fixed_vs_anneal10_speedup_p0_{p}",
                    f"fixed_vs_anneal3_speedup_p0_{p}", f"vspo_aligned_anneal3_p0_{p}_km_median_iters"):
            assert key in fig
    censored = {"km_median_iters": None, "cap": 30}
    assert ex._median_or_cap(censored, 30) == "not reached by 30"


# --- methods comparison --------------------------------------------------------------------------------------

def _common(**kw):
    args = {"model": "m", "behavior": "concise_answer", "max_words": 30, "train_path": "train.jsonl",
            "test_path": "test.jsonl", "eval_n": 24, "tokens": 64, "steps": 4, "batch_size": 8,
            "learning_rate": 5e-5, "quick": True, "curve_every": 1, "curve_n": 8, "target": 0.25}
    return ex.run_config(**(args | kw))


def test_parse_candidates_and_its_errors():
    assert ex.parse_candidates("all:1,1.5;answer:2") == [("all", [1.0, 1.5]), ("answer", [2.0])]
    with pytest.raises(ValueError, match="bad candidate"):
        ex.parse_candidates("all:x")
    with pytest.raises(ValueError, match="positions must be all or answer"):
        ex.parse_candidates("prompt:1")


def test_run_config_shares_one_setting_and_the_layer_only_when_given():
    c = _common()
    assert c["max_steps"] == 4 and c["eval_num_problems"] == 24 and c["steering_num_pairs"] == 16
    assert "steering_layers" not in c and _common(layer=3, quick=False)["steering_layers"] == [3]
    assert _common(quick=False)["steering_num_pairs"] == 32
    assert c["temperature"] == 0.7 and _common(temperature=1.0)["temperature"] == 1.0  # the rollouts' and the check's


def test_apply_pick_sets_the_runs_steering_from_the_alignment_check(tmp_path, capsys):
    pick = {"alpha": 1.0, "range": [1.0, 1.5], "positions": "answer"}
    c = ex.apply_pick(_common(), pick, tmp_path / "steering")
    assert (c["guidance_alpha"], c["alpha_max"], c["steering_positions"]) == (1.0, 1.5, "answer")
    assert c["aligned_alpha_range"] == [1.0, 1.5] and c["alpha_spread"] == "aligned"
    assert c["steering_vector"] == str(tmp_path / "steering")
    c = ex.apply_pick(_common(), {"alpha": None, "range": None}, tmp_path, alpha_max=3.0, aligned_share=0.5)
    assert (c["guidance_alpha"], c["alpha_max"], c["steering_positions"]) == (1.0, 3.0, "all")
    assert c["alpha_spread"] == "linspace" and "aligned_alpha_range" not in c and c["aligned_share"] == 0.5
    assert "no intensity range" in capsys.readouterr().out
    c = ex.apply_pick(_common(), {"alpha": 2.0, "range": None}, tmp_path, spread="uniform", guidance_alpha=0.5)
    assert c["alpha_spread"] == "uniform" and c["guidance_alpha"] == 0.5 and c["alpha_max"] == 0.5


def test_alignment_check_measures_every_candidate_on_held_out_rows_and_caches(tmp_path, monkeypatch, gsm8k_slice,
                                                                              tiny_model, tiny_tokenizer, capsys):
    import llmkit.models

    loads = []
    monkeypatch.setattr(llmkit.models, "load", lambda name: loads.append(name) or (tiny_model, tiny_tokenizer))
    common = _common(train_path=str(gsm8k_slice), test_path=str(gsm8k_slice), eval_n=1, tokens=4, layer=1)
    common.update({"steering_num_pairs": 2, "dataset_limit": 4})
    res = ex.alignment_check(common, tmp_path, candidates="all:1;answer:2,3", align_n=2, max_words=30)
    assert loads == ["m"] and res["n"] == 2 and res["temperature"] == 0.7 and res["candidates"] == "all:1;answer:2,3"
    assert [(r["vector"], r["positions"], r["alpha"]) for r in res["table"]] == [
        (None, "all", 0.0), ("layer1-all", "all", 1.0), ("layer1-answer", "answer", 2.0),
        ("layer1-answer", "answer", 3.0)]
    assert "aligned" in res["pick"] and (tmp_path / "steering" / "steering.safetensors").is_file()
    capsys.readouterr()
    again = ex.alignment_check(common, tmp_path, candidates="all:1;answer:2,3", align_n=2, max_words=30, reuse=True)
    assert loads == ["m"] and again == json.loads(json.dumps(res))  # from alignment.json, no model load
    assert capsys.readouterr().out.count("alignment ") == 4
    ex.alignment_check({**common, "temperature": 0.5}, tmp_path, candidates="all:1", align_n=2, max_words=30,
                       reuse=True)
    assert loads == ["m", "m"]  # another temperature: measured again


def test_plan_runs_guidance_once_then_every_arm_per_seed():
    p = ex.plan(_common(), 2)
    assert [name for _, name, _ in p] == ["guidance"] + [f"{m}-{s}" for s in range(2) for m in ex.RUN_MODES]
    assert p[0][2]["mode"] == "guidance" and p[0][2]["eval_before"] and "seed" not in p[0][2]
    fixed = {name: over for _, name, over in p}["vspo_fixed-1"]
    assert fixed["mode"] == "vspo" and fixed["alpha_anneal"] == "none" and fixed["seed"] == 1
    assert not fixed["eval_before"]


def _fake_run(out, over, reuse=False):
    r = random.Random(out.name)
    ev = {"after": {"n": 24, "behavior_rate": r.randrange(25) / 24, "accuracy": r.randrange(25) / 24,
                    "mean_words": 20.0}, "curve": [{"step": s, "behavior_rate": r.random()} for s in (1, 2)],
          "first_step_at_target": r.choice([None, 2]), "steps": 4, "train_seconds": 40.0, "rollouts_per_step": []}
    if over["mode"] == "guidance":
        ev["before"] = {"n": 24, "behavior_rate": 0.0, "accuracy": 0.04, "mean_words": 50.0}
    if over["mode"] == "vspo" and over.get("alpha_anneal") == "linear":
        ev["steered_share_above_base"] = 0.5
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(ev))
    (out / "bench_overrides.json").write_text(json.dumps(over))
    return ev


def test_collect_runs_splits_over_parts_and_claims(tmp_path):
    runs_plan = ex.plan(_common(), 1)
    runs, missing = ex.collect_runs(tmp_path, runs_plan, part="1/2", run=_fake_run)
    assert missing == ["vspo-0", "grpo-0"] and len(runs["guidance"]) == 1 and runs["vspo"] == []
    assert ex.finished(tmp_path / "vspo_fixed-0", runs_plan[2][2]) is not None
    assert ex.finished(tmp_path / "vspo_fixed-0", runs_plan[1][2]) is None  # other overrides: not this run
    runs, missing = ex.collect_runs(tmp_path, runs_plan, summarize_only=True, run=_fake_run)
    assert missing == ["vspo-0", "grpo-0"]
    assert ex.claim(tmp_path, "vspo-0") and not ex.claim(tmp_path, "vspo-0")
    runs, missing = ex.collect_runs(tmp_path, runs_plan, claim_runs=True, run=_fake_run)
    assert missing == ["vspo-0"] and len(runs["grpo"]) == 1  # claimed by another process, never finished


def test_method_figures_and_payload_keep_the_bench_keys(tmp_path):
    common = ex.apply_pick(_common(), {"alpha": 1.0, "range": [1.0, 1.5]}, tmp_path / "steering")
    runs, missing = ex.collect_runs(tmp_path, ex.plan(common, 2), run=_fake_run)
    summary = ex.summarize_methods(runs, 4)
    pick = {"aligned": True, "alpha": 1.0, "behavior_rate": 0.2, "base_behavior_rate": 0.0, "range": [1.0, 1.5]}
    base = runs["guidance"][0]["before"]
    fig = ex.method_figures(summary, runs, pick, base, common, seeds=2, missing=missing)
    assert fig["steered_share_above_base"] == 0.5 and fig["steered_share_above_base_vspo_fixed"] == 0.0
    assert fig["train_seconds_per_step_grpo"] == 10.0 and fig["seeds"] == 2 and fig["alpha_max"] == 1.5
    assert fig["first_step_at_target_guidance"] in (0, "not reached (no training)")
    for m in ex.METHODS:
        assert fig[f"behavior_rate_{m}"] == summary[m]["behavior_rate"]["rate"] and f"accuracy_{m}_ci95" in fig
    trained = [fig[f"first_step_at_target_{m}"] for m in ex.RUN_MODES]
    assert all(v == 2.0 or (isinstance(v, str) and v.startswith("not reached by step 4")) for v in trained)
    seeds_when_missing = ex.method_figures(summary, runs, pick, base, common, seeds=3, missing=["vspo-2"])["seeds"]
    assert seeds_when_missing == {m: 1 if m == "guidance" else 2 for m in ex.METHODS}
    payload = ex.methods_payload(fig, summary, {"pick": pick}, base, common, missing, 12.4, runs)
    assert payload["seconds"] == 12 and set(payload["base"]) == {"n", "behavior_rate", "accuracy", "mean_words"}
    assert set(payload["runs"]["vspo"][0]) == set(ex.RUN_KEYS) and payload["runs"]["vspo"][0]["curve"][0]["step"] == 1
    ex.plot_methods(summary, base, runs, tmp_path / "m.png", "t")
    assert (tmp_path / "m.png").stat().st_size > 0


def test_timing_figures_ratio_to_grpo():
    fig = ex.timing_figures({"grpo": [1.0, 2.0, 3.0], "vspo": [2.0, 3.0, 4.0]})
    assert fig == {"grpo_step_s": 2.0, "vspo_step_s": 3.0, "step_time_ratio_vs_grpo": 1.5}
    fig = ex.timing_figures({"grpo": [2.0], "vspo": [3.0], "vspo_is": [4.0]})
    assert fig["step_time_ratio_is_vs_grpo"] == 2.0


def test_write_results_and_print_figures(tmp_path, capsys):
    out = ex.write_results(tmp_path / "r", "x", {"a": 1})
    assert out.read_text() == '{\n  "a": 1\n}\n'
    ex.print_figures({"f": 0.12345, "s": "not reached", "i": 3})
    assert capsys.readouterr().out.splitlines() == ["f: 0.123", "s: not reached", "i: 3"]


# --- the thin benches ----------------------------------------------------------------------------------------

def test_bench_vspo_refuses_bad_parts_and_candidates(repo_root):
    b = _bench(repo_root, "vspo")
    assert b.parse_args(["--quick"]).part == "1/1"
    for bad in (["--part", "3/2"], ["--part", "0/1"], ["--align", "all:x"], ["--align", "prompt:1"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)


def test_bench_vspo_methods_writes_the_json_and_last_line(repo_root, tmp_path, monkeypatch, capsys):
    b = _bench(repo_root, "vspo")
    pick = {"aligned": True, "vector": "layer18-answer", "positions": "answer", "alpha": 1.0, "behavior_rate": 0.2,
            "base_behavior_rate": 0.0, "gain": 0.2, "range": [1.0, 1.5]}
    monkeypatch.setattr(b.ex, "alignment_check", lambda common, work, **kw: {"table": [], "pick": pick, "n": 4})
    monkeypatch.setattr(b.ex, "run_recipe", _fake_run)
    monkeypatch.setattr(b, "RESULTS", tmp_path / "results")
    b.main(["--quick", "--seeds", "2", "--work-dir", str(tmp_path / "work")])
    d = json.loads((tmp_path / "results" / "vspo_quick.json").read_text())
    assert set(d) == {"figures", "summary", "alignment", "base", "config", "missing_runs", "seconds", "runs"}
    assert d["config"]["steering_positions"] == "answer" and d["config"]["aligned_alpha_range"] == [1.0, 1.5]
    assert d["figures"]["steered_share_above_base"] == 0.5 and len(d["runs"]["vspo"]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {k: v for k, v in d["figures"].items() if not k.endswith("_ci95")}
    assert (tmp_path / "results" / "vspo_quick.png").is_file()


def test_bench_vspo_bandit_writes_the_json_and_last_line(repo_root, tmp_path, monkeypatch, capsys):
    b = _bench(repo_root, "vspo_bandit")
    monkeypatch.setattr(b, "RESULTS", tmp_path)
    b.main(["--quick", "--seeds", "2", "--max-iters", "20", "--p0", "0.05", "--anneal-sweep", "5"])
    d = json.loads((tmp_path / "vspo_bandit_quick.json").read_text())
    assert set(d) == {"figures", "summary", "iterations", "seeds", "config", "seconds", "note"}
    assert d["seeds"] == 2 and d["config"]["max_iters"] == 20 and d["config"]["p0"] == [0.05]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == d["figures"]
    assert (tmp_path / "vspo_bandit_quick.png").is_file()
