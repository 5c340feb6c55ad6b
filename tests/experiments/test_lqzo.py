"""The LQZO bench's experiment code (llmkit.experiments.lqzo): the tuned comparison, the presets, the saved
parts, the summary and the probes."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from torch import nn

from llmkit.experiments import lqzo as L


def test_the_sweep_skips_diverged_runs_takes_the_smallest_lr_on_ties_and_refuses_when_all_diverged():
    from llmkit.experiments.lqzo import merge_sweeps, recovered_fraction

    def sweep(vals):
        return {"sweep": [{"lr": lr, "val_loss": v, "train_loss": []} for lr, v in vals],
                "runs": [{"seed": 0, "test": {"eval_loss": 0.0}}]}

    assert merge_sweeps(sweep([(1, 2.0), (2, None)]), sweep([(3, 1.5), (4, float("nan"))]))["best_lr"] == 3
    m = merge_sweeps(sweep([(2, 1.0)]), sweep([(1, 1.0)]))
    assert m["best_lr"] == 1 and m["best_lr_at_edge"]  # ties: the smallest lr
    with pytest.raises(ValueError, match="diverged"):
        merge_sweeps(sweep([(1, None)]), sweep([(2, float("inf"))]))
    assert recovered_fraction(8.0, 5.0, 2.0) == pytest.approx(0.5)
    assert recovered_fraction(8.0, 9.0, 2.0) < 0  # got worse
    assert recovered_fraction(2.0, 1.0, 2.0) != recovered_fraction(2.0, 1.0, 2.0)  # no gap: nan


def test_tuned_runs_selects_on_validation_reports_test_and_reruns_the_chosen_lr_per_seed():
    from llmkit.experiments.lqzo import seed_stats, tuned_runs

    base = nn.Linear(1, 1, bias=False).requires_grad_(False)
    base.weight.data.fill_(0.0)
    calls = []

    def train(m, lr, seed):  # "training" moves the weight to lr (+ a seed offset); validation optimum at 0.3
        m.weight.data.fill_(lr + 0.01 * seed)
        calls.append((lr, seed))
        return [float(seed)]

    def val(m):
        w = float(m.weight)
        return float("nan") if w > 5 else (w - 0.3) ** 2

    test_seen = []

    def test(m):
        test_seen.append(float(m.weight))
        return {"eval_loss": float(m.weight), "accuracy": 0.5}

    r = tuned_runs(base, [0.1, 0.25, 0.5, 10.0], [0, 1, 2], train, val, test, log=lambda *_: None)
    assert r["best_lr"] == 0.25 and not r["best_lr_at_edge"]
    assert r["sweep"][3]["val_loss"] is None  # diverged, recorded as such
    assert calls == [(0.1, 0), (0.25, 0), (0.5, 0), (10.0, 0), (0.25, 1), (0.25, 2)]
    # test is only ever called on models trained at the chosen lr, once per seed; the base is untouched
    assert test_seen == pytest.approx([0.25, 0.26, 0.27])
    assert float(base.weight) == 0.0
    st = seed_stats(r["runs"], "eval_loss")
    assert st["mean"] == pytest.approx(0.26) and st["std"] == pytest.approx(0.01)
    assert st["lo"] < 0.25 and st["hi"] > 0.27 and st["values"] == pytest.approx([0.25, 0.26, 0.27])
    r = tuned_runs(base, [0.3, 1.0], [0], train, val, test, log=lambda *_: None)
    assert r["best_lr"] == 0.3 and r["best_lr_at_edge"]


def test_paired_seed_diff_pairs_by_seed_and_counts_wins():
    from llmkit.experiments.lqzo import paired_seed_diff

    a = [{"seed": 2, "test": {"eval_loss": 5.0}}, {"seed": 0, "test": {"eval_loss": 8.0}},
         {"seed": 1, "test": {"eval_loss": 7.5}}]
    b = [{"seed": 0, "test": {"eval_loss": 8.5}}, {"seed": 1, "test": {"eval_loss": 7.0}},
         {"seed": 3, "test": {"eval_loss": 1.0}}]
    d = paired_seed_diff(a, b)
    assert d["seeds"] == [0, 1]  # only the shared seeds, matched by seed and not by position
    assert d["diffs"] == pytest.approx([-0.5, 0.5])
    assert d["mean"] == pytest.approx(0.0) and d["std"] == pytest.approx(0.5 ** 0.5)
    assert d["a_better"] == 1 and d["lo"] < 0 < d["hi"]
    with pytest.raises(ValueError, match="no seed"):
        paired_seed_diff(a, [{"seed": 9, "test": {"eval_loss": 1.0}}])


def test_bench_splits_keep_train_validation_and_test_disjoint(tmp_path):
    from llmkit.experiments.lqzo import bench_splits

    rows = [{"question": f"train q{i}?", "answer": f"a{i}\n#### {i}"} for i in range(12)]
    test = [{"question": f"test q{i}?", "answer": f"b{i}\n#### {i}"} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    sp = bench_splits(8, 3, 4, 6, data_dir=tmp_path)
    train_q = {r["prompt"][0]["content"] for r in sp["train_ds"]}
    val_q = {r["question"] for r in sp["val_rows"]}
    test_q = {r["question"] for r in sp["test_rows"]}
    assert len(sp["train_ds"]) == 8 and len(val_q) == 3 and len(test_q) == 4 and len(sp["test_acc_rows"]) == 6
    assert {f"train q{i}?" for i in range(4)} <= train_q  # 4 GSM8K + 4 task rows
    assert val_q == {f"train q{i}?" for i in range(4, 7)}
    assert not (train_q & val_q) and not (train_q & test_q) and not (val_q & test_q)
    assert not {r["question"] for r in sp["test_acc_rows"]} & train_q
    with pytest.raises(ValueError, match="too few rows"):
        bench_splits(8, 20, 4, 6, data_dir=tmp_path)




def test_extending_a_sweep_tests_only_a_new_winner_and_merges():
    from llmkit.experiments.lqzo import merge_sweeps, tuned_runs

    base = nn.Linear(1, 1, bias=False).requires_grad_(False)
    tested = []

    def train(m, lr, seed):
        m.weight.data.fill_(lr)
        return []

    def val(m):
        return (float(m.weight) - 0.3) ** 2

    def test(m):
        tested.append(float(m.weight))
        return {"eval_loss": float(m.weight)}

    quiet = {"log": lambda *_: None}
    old = tuned_runs(base, [1.0, 2.0], [0], train, val, test, **quiet)
    assert old["best_lr"] == 1.0 and tested == [1.0]
    worse = tuned_runs(base, [4.0], [0], train, val, test, beat=old["sweep"][0]["val_loss"], **quiet)
    assert worse["runs"] == [] and tested == [1.0]  # no new winner: nothing tested
    m = merge_sweeps(old, worse)
    assert m["best_lr"] == 1.0 and m["runs"] == old["runs"] and [e["lr"] for e in m["sweep"]] == [1.0, 2.0, 4.0]
    assert m["best_lr_at_edge"]
    better = tuned_runs(base, [0.25], [0], train, val, test, beat=old["sweep"][0]["val_loss"], **quiet)
    assert tested == [1.0, 0.25]
    m = merge_sweeps(old, better)
    assert m["best_lr"] == 0.25 and m["runs"][0]["test"]["eval_loss"] == 0.25 and m["best_lr_at_edge"]
    with pytest.raises(ValueError, match="overlap"):
        merge_sweeps(old, old)


# ----------------------------------------------------------------------------- presets, parts, summary


def test_presets_quick_full_overrides_and_errors():
    q, f = L.presets(True), L.presets(False)
    assert (q["steps"], q["batch"], f["steps"], f["batch"]) == (40, 2, 200, 4)
    assert q["cell_seeds"]["lqzo_int2"] == 3 and q["cell_seeds"]["mezo"] == 1 and set(f["cell_seeds"]) == set(L.CELLS)
    o = L.presets(True, steps=5, lr_sweep=[1e-3], seeds=2, batch=1)
    assert (o["steps"], o["lrs"], o["batch"]) == (5, [1e-3], 1) and set(o["cell_seeds"].values()) == {2}
    with pytest.raises(ValueError, match=">= 1"):
        L.presets(True, seeds=0)


def test_parts_are_kept_per_configuration(tmp_path):
    bench = L.LqzoBench(L.presets(True), parts_dir=tmp_path, data_dir=None, cache=tmp_path / "cache")
    saved = bench.save("before_int2", {"val_loss": 1.0, "test": {"eval_loss": 2.0, "accuracy": 0.5}})
    assert saved["config"] == bench.data_config and bench.part("before_int2") == saved
    bench.save("mezo", {"best_lr": 1e-6})
    # another number of steps: the untrained metrics still hold, the trained cell does not
    other = L.LqzoBench(L.presets(True, steps=7), parts_dir=tmp_path, data_dir=None, cache=tmp_path)
    assert other.part("before_int2") == saved and other.part("mezo") is None
    fresh = L.LqzoBench(L.presets(True), parts_dir=tmp_path, data_dir=None, cache=tmp_path, fresh=True)
    assert fresh.part("before_int2") is None


@pytest.fixture()
def quick_bench(repo_root, tmp_path):
    """The committed quick run's parts, read by a bench with the quick configuration (nothing is trained)."""
    parts = tmp_path / "parts"
    shutil.copytree(repo_root / "bench" / "results" / "lqzo_quick_parts", parts)
    bench = L.LqzoBench(L.presets(True), parts_dir=parts, data_dir=None, cache=tmp_path / "cache", quick=True,
                        log=lambda *_: None)
    return bench, json.loads((repo_root / "bench" / "results" / "lqzo_quick.json").read_text())


def test_the_committed_parts_give_the_committed_summary(quick_bench, tmp_path):
    bench, committed = quick_bench
    res = bench.run(["fp", "int4", "int2", *L.CELLS])
    assert set(res["runs"]) == set(L.CELLS)
    res["summary"] = L.summarize(res, bench.probes(), log=lambda *_: None)
    assert set(res) == set(committed)
    for k, v in committed["summary"].items():
        got = res["summary"][k]
        assert got == pytest.approx(v, rel=1e-9, nan_ok=True) if isinstance(v, float) else got == v, k
    for cell in L.CELLS:
        assert set(res["runs"][cell]) == set(committed["runs"][cell]), cell
    L.plot(res, tmp_path / "lqzo.png")
    assert (tmp_path / "lqzo.png").stat().st_size > 10_000


def test_only_skip_and_a_failed_qlora_probe(quick_bench):
    bench, _ = quick_bench
    res = bench.run(["mezo"])  # only one cell: the others stay absent, so no summary is written
    assert list(res["runs"]) == ["mezo"] and "full_precision" not in res
    assert res["runs"]["mezo"]["test_loss"]["n"] == 1
    res = bench.run(["fp", "int4", "int2", *L.CELLS[:-1]], skip=["qlora_nf4"])
    memory = dict(bench.probes(), qlora_step_nf4={"error": "probe qlora failed"})
    s = L.summarize(res, memory, log=lambda *_: None)
    assert s["skipped"] == ["qlora_nf4"] and s["mem_ratio_vs_qlora"] is None
    assert math.isfinite(s["mem_ratio_vs_inference"]) and s["seeds_lqzo_int2"] == 3


def test_a_failed_probe_is_a_runtime_error_from_a_fresh_process():
    """The probe's process imports no model (``llmkit.experiments.lqzo`` imports torch only where used)."""
    with pytest.raises(RuntimeError, match="probe bogus failed: ValueError"):
        L.run_probe("bogus")


def test_a_cell_is_saved_and_extend_runs_only_the_learning_rates_it_lacks(tmp_path, monkeypatch):
    p = L.presets(True, lr_sweep=[1.0, 2.0], seeds=2)
    bench = L.LqzoBench(p, parts_dir=tmp_path, data_dir=None, cache=tmp_path, log=lambda *_: None)
    base = nn.Linear(1, 1, bias=False).requires_grad_(False)
    trained = []

    def fake_train(m, tok, ds, settings, steps, lr, batch, max_length, out, seed=0):
        m.weight.data.fill_(lr)
        trained.append((lr, seed))
        return [{"loss": lr}]

    monkeypatch.setattr(L, "load_model", lambda *a, **k: (base, None))
    monkeypatch.setattr(L, "train_zo", fake_train)
    monkeypatch.setattr(L.LqzoBench, "sp", {"train_ds": None})
    monkeypatch.setattr(bench, "val_loss", lambda m, tok: (float(m.weight) - 0.3) ** 2)
    monkeypatch.setattr(bench, "test", lambda m, tok: {"eval_loss": float(m.weight), "accuracy": 0.5})
    part = bench.train_cell("lqzo_int2")
    assert (part["best_lr"], part["lrs"], part["seeds"]) == (1.0, [1.0, 2.0], [0, 1])
    assert trained == [(1.0, 0), (2.0, 0), (1.0, 1)]
    assert bench.part("lqzo_int2")["runs"] == part["runs"]  # saved
    bench.p = dict(p, lrs=[0.25, 1.0, 2.0])
    trained.clear()
    ext = bench.train_cell("lqzo_int2", extend=True)
    assert trained == [(0.25, 0), (0.25, 1)]  # only the new lr, then its reruns: it won
    assert (ext["best_lr"], ext["lrs"], [e["lr"] for e in ext["sweep"]]) == (0.25, [0.25, 1.0, 2.0], [0.25, 1.0, 2.0])
    trained.clear()
    assert bench.train_cell("lqzo_int2", extend=True)["best_lr"] == 0.25 and trained == []  # nothing new to run
