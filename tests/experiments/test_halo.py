"""The HALO comparison's library: learning-rate sweep, seeded subsets, censoring, statistics, one real run."""

from __future__ import annotations

import json
import math

import pytest

from llmkit.experiments import halo as ex


def test_pick_best_lr_takes_the_lowest_finite_loss():
    assert ex.pick_best_lr({1e-5: 1.2, 1e-4: 0.9, 1e-3: 1.0}) == 1e-4
    # a diverged run (nan/inf) or a missing one never wins
    assert ex.pick_best_lr({1e-5: 1.2, 1e-4: math.nan, 1e-3: math.inf, 3e-3: None}) == 1e-5
    # ties go to the smaller rate
    assert ex.pick_best_lr({3e-4: 1.0, 1e-4: 1.0}) == 1e-4
    with pytest.raises(ValueError, match="diverged"):
        ex.pick_best_lr({1e-4: math.nan})


def test_train_subset_is_seeded_nested_and_checked():
    pool = [{"i": i} for i in range(50)]
    a, b = ex.train_subset(pool, 8, 0), ex.train_subset(pool, 8, 0)
    assert a == b and len({r["i"] for r in a}) == 8
    assert ex.train_subset(pool, 8, 1) != a
    assert ex.train_subset(pool, 32, 0)[:8] == a  # the small set is inside the large one
    with pytest.raises(ValueError, match="pool has 50"):
        ex.train_subset(pool, 51, 0)


def test_steps_to_target_and_censoring():
    curve = [(0, 0.0, 2.0), (2, 1.0, 1.5), (4, 2.0, 1.1), (6, 3.0, 1.0)]
    assert ex.steps_to_target(curve, 1.1) == (4, 2.0)
    assert ex.steps_to_target(curve, 0.5) == (None, None)
    assert ex.steps_to_target(curve, None) == (None, None)
    # the step-0 point never counts, even when it is already below the target
    assert ex.steps_to_target(curve, 2.5) == (2, 1.0)


def test_spread_uses_the_sample_std_and_skips_missing():
    s = ex.spread([1.0, 2.0, 3.0, None])
    assert s["mean"] == 2.0 and s["std"] == 1.0 and s["n"] == 3 and (s["min"], s["max"]) == (1.0, 3.0)
    assert ex.spread([5.0])["std"] == 0.0
    assert ex.spread([None, math.nan])["mean"] is None


def _run(method, seed, n, finals, forgetting=0.0, lr=1e-4):
    curve = [(0, 0.0, 2.0)] + [(2 * (i + 1), float(i + 1), v) for i, v in enumerate(finals)]
    return {"spec": ex.RunSpec(method=method, lr=lr, seed=seed, n_train=n, steps=2 * len(finals)).as_dict(),
            "curve": curve, "initial_val": 2.0, "forgetting": forgetting, "train_s": float(len(finals)),
            "opt_bytes_mean": 2**20, "opt_bytes_peak": 2**21}


def test_summarize_runs_target_from_full_and_censored_runs_are_not_the_cap():
    runs = [_run("full", s, 8, [1.5, 1.0]) for s in range(3)]
    # target = 2 - 0.8 * (2 - 1.0) = 1.2: halo seed 0 reaches it at step 4, seeds 1 and 2 never do
    runs += [_run("halo", 0, 8, [1.6, 1.1], forgetting=0.1), _run("halo", 1, 8, [1.7, 1.3], forgetting=0.3),
             _run("halo", 2, 8, [1.8, 1.5], forgetting=0.2)]
    s = ex.summarize_runs(runs)[8]
    assert s["target_val_loss"] == pytest.approx(1.2)
    full, halo = s["methods"]["full"], s["methods"]["halo"]
    assert full["reached"] == 3 and full["steps_to_target"]["mean"] == 4
    assert halo["reached"] == 1 and halo["steps_to_target_per_seed"] == [4, None, None]
    assert halo["steps_to_target"]["n"] == 1  # censored runs are left out, not counted as the budget
    assert halo["final_val_loss"]["mean"] == pytest.approx(1.3) and halo["final_val_loss"]["std"] == pytest.approx(0.2)
    assert halo["forgetting"]["mean"] == pytest.approx(0.2)
    figs = ex.flat_figures({8: s}, primary_n=8)
    assert figs["final_val_loss_halo"] == pytest.approx(1.3) and figs["final_val_loss_halo_std"] == pytest.approx(0.2)
    assert figs["reached_halo"] == 1 and figs["steps_ratio_halo"] == 1.0
    with pytest.raises(ValueError, match="full-finetuning"):
        ex.summarize_runs([r for r in runs if r["spec"]["method"] == "halo"])


def test_flat_figures_suffixes_the_non_primary_size():
    runs = [_run("full", 0, 8, [1.0]), _run("full", 0, 64, [0.8])]
    figs = ex.flat_figures(ex.summarize_runs(runs), primary_n=64)
    assert figs["final_val_loss_full"] == 0.8 and figs["final_val_loss_full_n8"] == 1.0


def test_run_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown schedule"):
        ex.RunSpec(method="nope", lr=1e-4, seed=0, n_train=4, steps=2)
    with pytest.raises(ValueError, match="learning rate"):
        ex.RunSpec(method="halo", lr=0.0, seed=0, n_train=4, steps=2)
    with pytest.raises(ValueError, match="steps"):
        ex.RunSpec(method="halo", lr=1e-4, seed=0, n_train=4, steps=0)


def test_train_run_on_a_tiny_tied_model(tmp_path, gsm8k_slice):
    from llmkit.testing import tiny_llama, tiny_tokenizer
    from llmkit.train.common import load_records

    model, tok = tiny_llama(), tiny_tokenizer()
    model.lm_head.weight = model.model.embed_tokens.weight
    rows = load_records(str(gsm8k_slice))
    before = model.model.embed_tokens.weight.detach().clone()
    spec = ex.RunSpec(method="halo", lr=1e-3, seed=0, n_train=4, steps=2, batch=2, max_length=512, eval_every=1)
    r = ex.train_run(model, tok, ex.train_subset(rows, 4, 0), spec, val_rows=rows[:2],
                     end_sets={"forget": rows[2:4]}, end_max_length=600, out_dir=tmp_path, log=lambda m: None)
    assert [c[0] for c in r["curve"]] == [0, 1, 2]
    assert all(math.isfinite(c[2]) for c in r["curve"]) and r["curve"][0][1] == 0.0
    assert set(r["end_losses"]) == {"forget"} and math.isfinite(r["end_losses"]["forget"])
    assert r["units"] == 4 and r["opt_bytes_peak"] > 0 and r["spec"]["method"] == "halo"
    # the base model is left untouched (each run trains a copy)
    assert (model.model.embed_tokens.weight == before).all()
    # a known initial loss is taken as the curve's first point
    r2 = ex.train_run(model, tok, ex.train_subset(rows, 4, 0), spec, val_rows=rows[:2], initial_val=123.0,
                      out_dir=tmp_path, log=lambda m: None)
    assert r2["curve"][0] == (0, 0.0, 123.0)
    assert [(c[0], c[2]) for c in r2["curve"][1:]] == [(c[0], c[2]) for c in r["curve"][1:]]  # seeded: same run


def test_rates_per_size_uses_each_sizes_own_sweep_and_never_borrows_one():
    sweep = {"full": {8: {1e-4: 1.0, 3e-4: 0.9}, 32: {1e-4: 0.7, 3e-4: 0.8}},
             "halo": {8: {1e-4: 1.1, 3e-4: 1.2}, 32: {1e-4: None, 3e-4: None}}}
    assert ex.rates_per_size(sweep, [8, 32]) == {("full", 8): 3e-4, ("full", 32): 1e-4, ("halo", 8): 1e-4}
    # the one-sweep protocol: the smallest size's rate everywhere
    assert ex.rates_per_size(sweep, [8, 32], per_size=False) == {
        ("full", 8): 3e-4, ("full", 32): 3e-4, ("halo", 8): 1e-4, ("halo", 32): 1e-4}


def test_flat_figures_give_each_size_its_own_rate():
    runs = [_run("full", 0, 8, [1.0], lr=3e-4), _run("full", 0, 64, [0.8], lr=1e-4)]
    figs = ex.flat_figures(ex.summarize_runs(runs), primary_n=64)
    assert figs["lr_full"] == 1e-4 and figs["lr_full_n8"] == 3e-4


def test_resolve_config_and_run_settings():
    cfg = ex.resolve_config(True, {"steps": 10, "sizes": None})
    assert cfg["steps"] == 10 and cfg["sizes"] == ex.QUICK["sizes"]
    assert ex.resolve_config(False, {})["sizes"] == ex.FULL["sizes"]
    with pytest.raises(ValueError, match="unknown setting"):
        ex.resolve_config(True, {"stepz": 1})
    common = ex.run_settings(cfg, homotopy_fraction=0.4)
    assert common["lisa_interval"] == 2 and common["homotopy_fraction"] == 0.4
    ex.RunSpec(method="halo", lr=1e-4, seed=0, n_train=8, **common)  # every field is a RunSpec field


def _fake_train_run(calls):
    def train_run(base, tok, rows, spec, *, val_rows=None, initial_val=None, end_sets=None, **kw):
        calls.append(spec.key())
        loss = 1.0 + abs(math.log10(spec.lr) + 4)  # best rate 1e-4
        curve = [(0, 0.0, initial_val)] + [(s, float(s), initial_val - 0.1 * s) for s in (1, 2)] if val_rows else []
        return {"spec": spec.as_dict(), "curve": curve, "train_losses": [(1, 1.0)], "train_s": 2.0, "wall_s": 2.5,
                "end_losses": {k: loss for k in end_sets}, "opt_bytes_mean": 2**20, "opt_bytes_peak": 2**20,
                "units": 4}
    return train_run


def test_runs_train_once_resume_from_the_store_and_load_the_workload_lazily(tmp_path, monkeypatch):
    from llmkit.experiments.harness import ResultStore

    calls, loads = [], []
    monkeypatch.setattr(ex, "train_run", _fake_train_run(calls))

    def workload():
        loads.append(1)
        return {"base": None, "tok": None, "pool": [{"i": i} for i in range(20)], "sweep": [], "val": [{}],
                "forget": [{}], "init_val": 2.0, "init_forget": 1.5}

    data = {k: 1 for k in ex.DATA_KEYS} | {"forget_max_length": 64}
    common = ex.run_settings(ex.resolve_config(True, {"steps": 2, "eval_every": 1}))
    reader = ex.Runs(ResultStore(tmp_path, data), workload, train=(), log=lambda m: None)
    spec = ex.RunSpec(method="full", lr=1e-4, seed=0, n_train=4, **common)
    assert reader("run", spec, with_val=True) is None and not loads  # nothing saved, nothing trained

    runs = ex.Runs(ResultStore(tmp_path, data), workload, train=("full",), log=lambda m: None)
    r = runs("run", spec, with_val=True)
    assert r["data"] == data and r["initial_val"] == 2.0 and r["forgetting"] == pytest.approx(r["end_losses"]["forget"] - 1.5)
    saved = json.loads(json.dumps(r))  # tuples come back as lists
    assert runs("run", spec, with_val=True) == saved and calls == [spec.key()] and loads == [1]  # read, not retrained
    assert reader("run", spec, with_val=True) == saved  # another invocation reads the part
    other = ex.Runs(ResultStore(tmp_path, data | {"n_val": 2}), workload, train=(), log=lambda m: None)
    assert other("run", spec, with_val=True) is None  # other data settings: the part does not count
    fresh = ex.Runs(ResultStore(tmp_path, data, fresh=True), workload, train=("full",), log=lambda m: None)
    fresh("run", spec, with_val=True)
    assert len(calls) == 2


def test_sweep_comparison_and_report_end_to_end_on_fake_runs(tmp_path, monkeypatch):
    from llmkit.experiments.harness import ResultStore

    calls = []
    monkeypatch.setattr(ex, "train_run", _fake_train_run(calls))
    workload = lambda: {"base": None, "tok": None, "pool": [{"i": i} for i in range(20)], "sweep": [],
                        "val": [{}], "forget": [{}], "init_val": 2.0, "init_forget": 1.5}
    runs = ex.Runs(ResultStore(tmp_path, {"forget_max_length": 64}), workload, train=("full", "halo"),
                   log=lambda m: None)
    common = ex.run_settings(ex.resolve_config(True, {"steps": 2, "eval_every": 1}))
    lines = []
    sweep = ex.sweep_rates(runs, [4], [1e-5, 1e-4, 1e-3], common, log=lines.append)
    assert list(sweep) == list(ex.SCHEDULES) and sweep["lisa"][4] == dict.fromkeys([1e-5, 1e-4, 1e-3])
    assert any(line.startswith("sweep halo n=4") and line.endswith("-> 0.0001") for line in lines)
    rates = ex.rates_per_size(sweep, [4, 8], per_size=False)
    assert rates == {("full", 4): 1e-4, ("full", 8): 1e-4, ("halo", 4): 1e-4, ("halo", 8): 1e-4}
    done = ex.comparison_runs(runs, rates, [0, 1], [4, 8], common)
    assert [(r["spec"]["seed"], r["spec"]["n_train"], r["spec"]["method"]) for r in done][:3] == [
        (0, 4, "full"), (0, 4, "halo"), (0, 8, "full")]  # seed-major
    report, summary = ex.build_report(done, sweep, {"quick": True, "pool": 20, "n_sweep": 4, "n_val": 1,
                                                    "n_forget": 1})
    assert set(report) == {"config", "figures", "sweep", "summary", "runs"}
    assert report["figures"]["seeds"] == 2 and report["figures"]["sizes"] == [4, 8]
    assert report["sweep"]["full"]["4"]["0.0001"] == 1.0 and set(report["summary"]) == {"4", "8"}
    assert all("train_losses" not in r for r in report["runs"]) and report["config"]["units"] == 4
    assert report["config"]["data"]["sweep"] == "gsm8k/train.jsonl rows 7000-7003"
    assert "lr_full: 0.0001" in ex.figure_lines(report["figures"])
    assert ex.plot_summary(done, summary, tmp_path / "p.png").is_file()
