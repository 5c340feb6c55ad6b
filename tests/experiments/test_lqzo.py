"""The LQZO bench's experiment code (llmkit.experiments.lqzo): the tuned comparison, the presets, the saved
parts, the summary and the probes."""

from __future__ import annotations

import copy
import itertools
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
    # QZO's additive steps have their own grid; an explicit --lr-sweep alone sets both (one cell per --only)
    grid = L.LqzoBench(q, parts_dir="unused", data_dir=None, cache="unused").grid
    assert (grid("qzo"), grid("lqzo"), grid("mezo")) == (L.QZO_LRS, q["lrs"], q["mezo_lrs"])
    assert o["qzo_lrs"] == [1e-3] and L.presets(True, lr_sweep=[1.0], qzo_lr_sweep=[2.0])["qzo_lrs"] == [2.0]


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
    res = bench.run(["mezo"])  # one cell asked for: the others (and the untrained metrics) come from their parts
    assert list(res["runs"]) == list(L.CELLS) and {"full_precision", "int4_before", "int2_before"} <= set(res)
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


def test_the_qlora_reference_is_tuned_on_validation_from_a_fresh_model_per_run(tmp_path, monkeypatch):
    """QLoRA's lr is picked like the ZO cells' (validation, then test); each run starts from a fresh load
    (a 4-bit model is reloaded, not deep-copied), and the part says what the untrained NF4 model scored."""
    p = L.presets(True, qlora_lr_sweep=[1.0, 0.1, 3.0], seeds=2)
    assert p["qlora_lrs"] == [1.0, 0.1, 3.0] and L.presets(True)["cell_seeds"]["qlora_nf4"] == 1
    bench = L.LqzoBench(p, parts_dir=tmp_path, data_dir=None, cache=tmp_path, log=lambda *_: None)
    loads, trained = [], []

    def fake_model():
        m = nn.Linear(1, 1, bias=False).requires_grad_(False)
        m.weight.data.fill_(0.0)
        loads.append(m)
        return m, None

    def fake_train(m, tok, ds, steps, lr, batch, max_length, out, seed=0):
        assert float(m.weight) == 0.0 and steps == bench.fwd  # untouched by any earlier run
        m.weight.data.fill_(lr)
        trained.append((lr, seed))
        return [{"loss": lr}]

    monkeypatch.setattr(L, "qlora_model", fake_model)
    monkeypatch.setattr(L, "train_qlora", fake_train)
    monkeypatch.setattr(L.LqzoBench, "sp", {"train_ds": None})
    monkeypatch.setattr(bench, "val_loss", lambda m, tok: (float(m.weight) - 0.8) ** 2)
    monkeypatch.setattr(bench, "test", lambda m, tok: {"eval_loss": 2.0 - float(m.weight), "accuracy": 0.5})
    part = bench.qlora_cell()
    assert trained == [(0.1, 0), (1.0, 0), (3.0, 0), (1.0, 1)] and len(loads) == 5  # the untrained one + 4 runs
    assert (part["best_lr"], part["best_lr_at_edge"], part["lrs"]) == (1.0, False, [0.1, 1.0, 3.0])
    assert part["before"]["eval_loss"] == 2.0 and [r["test"]["eval_loss"] for r in part["runs"]] == [1.0, 1.0]
    assert bench.part("qlora_nf4")["runs"] == part["runs"]  # saved, and read back by run()
    res = bench.run(["qlora_nf4"])
    assert res["runs"]["qlora_nf4"]["test_loss"]["mean"] == 1.0 and trained[-1] == (1.0, 1)  # nothing retrained
    bench.p = dict(p, qlora_lrs=[0.1, 0.8, 1.0, 3.0])  # extend: only the new lr, which wins, then its rerun
    n = len(loads)
    ext = bench.qlora_cell(extend=True)
    assert trained[4:] == [(0.8, 0), (0.8, 1)] and len(loads) == n + 3  # 2 runs + the base (tokenizer, untouched)
    assert (ext["best_lr"], ext["lrs"], ext["before"]) == (0.8, [0.1, 0.8, 1.0, 3.0], part["before"])


# ----------------------------------------------------------------------------- the long preset


def test_long_preset_sizes_and_errors():
    from llmkit.experiments.lqzo_long import LONG_CELLS

    p = L.presets(False, long=True)
    assert (p["steps"], p["batch"], p["n_train"]) == (1000, 1, 1000)  # every training row seen once
    assert p["cell_seeds"] == {"qzo_int2": 5, "lqzo_int2": 5, "qzo_int4": 3, "lqzo_int4": 3}
    assert set(p["skip"]) == {"mezo", "qlora_nf4"}
    assert set(LONG_CELLS) == {"qzo_int2", "lqzo_int2", "qzo_int4", "lqzo_int4"}
    lrs = p["lrs"]
    assert len(lrs) == 4 and all(b / a == pytest.approx(4.0) for a, b in itertools.pairwise(lrs))
    assert (p["n_val"], p["n_test"], p["n_acc"]) == (64, 128, 128)
    o = L.presets(False, steps=10, batch=2, seeds=2, lr_sweep=[1e-3], long=True)
    assert (o["steps"], o["batch"], o["n_train"], o["lrs"], set(o["cell_seeds"].values())) == (10, 2, 20, [1e-3], {2})
    with pytest.raises(ValueError, match="choose one"):
        L.presets(True, long=True)
    with pytest.raises(ValueError, match=">= 1"):
        L.presets(False, seeds=0, long=True)
    bench = L.LqzoBench(p, parts_dir="unused", data_dir=None, cache="unused")
    assert bench.config["task"] == "sentiment" and bench.data_config["task"] == "sentiment"
    assert "task" not in L.LqzoBench(L.presets(True), parts_dir="unused", data_dir=None, cache="unused").config


def test_long_splits_are_sentiment_rows_with_no_question_in_two_splits():
    from llmkit.experiments.lqzo_long import long_splits

    sp = long_splits(300, 40, 50)
    train = [r["prompt"][0]["content"] for r in sp["train_ds"]]
    val, test = [r["question"] for r in sp["val_rows"]], [r["question"] for r in sp["test_rows"]]
    assert (len(train), len(val), len(test)) == (300, 40, 50) and sp["test_acc_rows"] == sp["test_rows"]
    assert not (set(train) & set(val)) and not (set(train) & set(test)) and not (set(val) & set(test))
    assert len(set(val)) == 40 and len(set(test)) == 50
    assert all(r["answer"] in ("positive", "negative") and "Review" in r["question"] for r in sp["test_rows"])
    assert long_splits(300, 40, 50)["val_rows"] == sp["val_rows"]  # deterministic


def test_tuned_runs_by_part_saves_each_run_and_resumes_after_an_interruption():
    from llmkit.experiments.lqzo_long import tuned_runs_by_part

    base = nn.Linear(1, 1, bias=False).requires_grad_(False)
    base.weight.data.fill_(0.0)
    saved, trained, tested, logs = {}, [], [], []
    stop = {"at": 2}

    def train(m, lr, seed):
        if len(trained) == stop["at"]:
            raise KeyboardInterrupt  # the run in progress is lost, the finished ones are saved
        m.weight.data.fill_(lr + 0.01 * seed)
        trained.append((lr, seed))
        return [lr]

    def test(m):
        tested.append(float(m.weight))
        return {"eval_loss": float(m.weight), "accuracy": 0.5}

    def go():
        return tuned_runs_by_part(base, [1.0, 0.3, 0.1], [0, 1, 2], train, lambda m: (float(m.weight) - 0.3) ** 2,
                                  test, lambda lr, s: saved.get((lr, s)), lambda lr, s, r: saved.update({(lr, s): r}),
                                  log=logs.append, name="cell")

    with pytest.raises(KeyboardInterrupt):
        go()
    assert sorted(saved) == [(0.1, 0), (0.3, 0)] and tested == []
    stop["at"] = 4
    with pytest.raises(KeyboardInterrupt):
        go()  # trains the missing lr; the chosen (0.3, seed 0) is not in memory and has no snapshot: rerun, tested
    assert trained == [(0.1, 0), (0.3, 0), (1.0, 0), (0.3, 0)] and tested == pytest.approx([0.3])
    assert "test" in saved[(0.3, 0)] and (0.3, 1) not in saved
    stop["at"] = None
    r = go()
    assert trained[4:] == [(0.3, 1), (0.3, 2)] and tested == pytest.approx([0.3, 0.31, 0.32])
    assert r["best_lr"] == 0.3 and not r["best_lr_at_edge"] and [x["seed"] for x in r["runs"]] == [0, 1, 2]
    assert [e["lr"] for e in r["sweep"]] == [0.1, 0.3, 1.0] and all(x["train_s"] >= 0 for x in r["runs"])
    n = len(trained)
    assert go() == r and len(trained) == n  # everything saved: nothing trained or tested again
    assert not any("!!!" in line for line in logs)
    tuned_runs_by_part(base, [0.5, 1.0], [0], train, lambda m: (float(m.weight) - 0.3) ** 2, test,
                       lambda lr, s: None, lambda *a: None, log=logs.append, name="edgy")
    assert any("!!! edgy" in line and "edge" in line for line in logs)  # said loudly


def _fake_long_bench(tmp_path, monkeypatch, lrs=(0.1, 0.3, 1.0), logs=None):
    """A long-preset bench whose model is a 1x1 linear layer and whose training sets the weight: LQZO lands
    0.05 + 0.01 * seed below QZO at every seed (test loss = the weight)."""
    p = L.presets(False, long=True, lr_sweep=list(lrs), seeds=3)
    bench = L.LqzoBench(p, parts_dir=tmp_path / "parts", data_dir=None, cache=tmp_path / "cache",
                        log=(logs.append if logs is not None else lambda *_: None))
    base = nn.Linear(1, 1, bias=False).requires_grad_(False)
    base.weight.data.fill_(0.0)
    trained = []

    def fake_train(m, tok, ds, settings, steps, lr, batch, max_length, out, seed=0):
        off = 0.0 if settings["method"] == "lqzo" else 0.05 + 0.01 * seed
        m.weight.data.fill_(lr + off + 0.001 * seed)
        trained.append((settings["method"], settings["quant_bits"], lr, seed))
        return [{"loss": lr}]

    monkeypatch.setattr(L, "load_model", lambda *a, **k: (copy.deepcopy(base), None))
    monkeypatch.setattr(L, "train_zo", fake_train)
    monkeypatch.setattr(L.LqzoBench, "sp", {"train_ds": None})
    monkeypatch.setattr(bench, "val_loss", lambda m, tok: (float(m.weight) - 0.3) ** 2)
    monkeypatch.setattr(bench, "test", lambda m, tok: {"eval_loss": float(m.weight), "accuracy": 1 - float(m.weight)})
    for name, loss in (("before_fp", 0.2), ("before_int4", 0.9), ("before_int2", 5.0)):
        bench.save(name, {"val_loss": loss, "test": {"eval_loss": loss, "accuracy": 0.5}})
    memory = {"inference_int4": {"peak_bytes": 100}, "qlora_step_nf4": {"error": "probe qlora failed"},
              "lqzo_step_int4": {"peak_bytes": 104, "step_s": 1.1, "two_forward_s": 1.0, "zo_overhead_s": 0.05}}
    bench.store.save("probes", memory, bench.probe_config)
    return bench, trained


def test_long_bench_saves_every_run_as_a_part_and_an_interrupted_cell_loses_only_the_run_in_progress(
        tmp_path, monkeypatch):
    bench, trained = _fake_long_bench(tmp_path, monkeypatch)
    real = L.train_zo

    def dies_on_the_third(*a, **k):
        if len(trained) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(L, "train_zo", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        bench.run(["lqzo_int2"])
    parts = sorted(f.name for f in (tmp_path / "parts").glob("run_*.json"))
    assert parts == ["run_lqzo_int2_lr0.1_seed0.json", "run_lqzo_int2_lr0.3_seed0.json"]
    assert len(list((tmp_path / "cache" / "lqzo_long_runs").glob("*lqzo_int2*"))) == 2  # their trained tensors
    monkeypatch.setattr(L, "train_zo", real)
    trained.clear()
    res = bench.run(["lqzo_int2"])  # a fresh process would do the same: the saved runs are reused
    # only the lost run and the reruns per seed; the chosen sweep run (0.3, seed 0) is tested from its snapshot
    assert trained == [("lqzo", 2, 1.0, 0), ("lqzo", 2, 0.3, 1), ("lqzo", 2, 0.3, 2)]
    cell = res["runs"]["lqzo_int2"]
    assert cell["best_lr"] == 0.3 and [r["test"]["eval_loss"] for r in cell["runs"]] == pytest.approx(
        [0.3, 0.301, 0.302])
    trained.clear()
    again = bench.run(["lqzo_int2"])
    assert trained == [] and again["runs"]["lqzo_int2"]["runs"] == cell["runs"]
    bench.p = dict(bench.p, lrs=[0.03])
    bench.run(["lqzo_int2"], extend=True)  # --extend: only the new lr; it loses, so nothing else runs
    assert trained == [("lqzo", 2, 0.03, 0)] and bench.part("lqzo_int2")["lrs"] == [0.03, 0.1, 0.3, 1.0]


def test_long_summary_has_the_comparison_keys_and_says_the_int2_verdict(tmp_path, monkeypatch):
    logs = []
    bench, trained = _fake_long_bench(tmp_path, monkeypatch, logs=logs)
    from llmkit.experiments.lqzo_long import summarize_long

    # two processes, one per bit-width (--only), then the summary from the saved parts
    bench.run(["int2", "qzo_int2", "lqzo_int2"])
    bench.run(["fp", "int4", "qzo_int4", "lqzo_int4"])
    n = len(trained)
    res = bench.run()
    assert len(trained) == n and res["runs"]["mezo"] == {"skipped": "left out of this run (--skip)"}
    s = summarize_long(res, bench.probes(), log=logs.append)
    for key in ("loss_after_lqzo_int2", "loss_after_qzo_int2", "loss_after_lqzo_int4", "loss_after_qzo_int4",
                "acc_before_int2", "acc_after_lqzo_int2", "acc_after_qzo_int2", "acc_after_lqzo_int4",
                "mem_ratio_vs_inference", "step_time_ratio_vs_2fwd", "step_time_ratio_from_zo_overhead"):
        assert s[key] is not None and math.isfinite(s[key]), key
    for bits in (2, 4):
        d, a = s[f"paired_diff_int{bits}"], s[f"paired_acc_diff_int{bits}"]
        assert d["n"] == 3 and d["seeds"] == [0, 1, 2] and d["a_better"] == 3
        assert d["diffs"] == pytest.approx([-0.05, -0.06, -0.07]) and d["lo"] < d["mean"] < d["hi"] < 0
        assert a["diffs"] == pytest.approx([0.05, 0.06, 0.07])
    assert s["int2_claim"].startswith("shown")
    assert s["loss_after_lqzo_int2"] == pytest.approx(0.301) and s["loss_before_int2"] == 5.0
    assert s["steps_per_run"] == 1000 and s["batch"] == 1 and s["step_s"] >= 0 and s["train_core_hours"] >= 0
    assert s["skipped"] == ["mezo", "qlora_nf4"] and s["lr_at_edge"] == [] and s["mem_ratio_vs_qlora"] is None
    assert json.loads(json.dumps(s)) == s  # JSON-able as written
    assert any("paper's INT2 claim" in line for line in logs)
