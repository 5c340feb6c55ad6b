"""The HG-MS bench's experiment code (llmkit.experiments.hgms): data, run order, summary and plot; training
itself is the recipe's (tests/train/hgms)."""

from __future__ import annotations

import json

import pytest

from llmkit.experiments import hgms as H


def test_lora_targets_are_the_last_layers_q_and_v():
    assert H.lora_targets(30, 2) == ["model.layers.28.self_attn.q_proj", "model.layers.28.self_attn.v_proj",
                                     "model.layers.29.self_attn.q_proj", "model.layers.29.self_attn.v_proj"]


def test_presets_share_their_keys():
    assert H.QUICK.keys() == H.FULL.keys() and H.QUICK["steps"] < H.FULL["steps"]


def test_build_data_writes_the_mixture_and_reads_held_out_rows(tmp_path):
    data = tmp_path / "shared"
    for sub, n in (("gsm8k/train.jsonl", 40), ("gsm8k/test.jsonl", 10), ("math500/test.jsonl", 10)):
        f = data / sub
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps({"question": f"{sub} q{i}? a b c", "answer": f"x y {i}\n#### {i}"}) + "\n"
                             for i in range(n)))
    cfg = dict(H.QUICK, n_clean=8, n_noisy=8, n_target=4, n_heldout=3, n_math=2)
    files, heldout = H.build_data(cfg, data, tmp_path / "work")
    assert {"gsm8k", "noisy", "target"} <= set(files)
    assert all(str(p).startswith(str(tmp_path / "work" / "data")) for p in (files["gsm8k"], files["noisy"]))
    assert len(heldout["gsm8k"]) == 3 and len(heldout["math500"]) == 2


def _fake_run(method, cfg, files, work, reference, heldout, seed, gsm8k_test):
    loss = {"uniform": 1.0, "hgms": 0.9, "doremi": 1.1}[method] + 0.01 * seed
    r = {"method": method, "seed": seed, "reference": reference, "heldout_loss": loss, "math500_loss": loss + 1,
         "target_loss": loss, "final_weights": {"gsm8k": 0.6, "noisy": 0.4 - 0.1 * seed}, "s_per_step": 1.0 + seed,
         "train_s": 10.0, "weighting_s": 2.0 if method == "hgms" else 0.0,
         "weight_refusals": int(method == "hgms" and seed == 0), "weight_updates": 0 if method == "uniform" else 2,
         "extra_passes": {"forward": 1, "backward": 2, "double_backward": 3},
         "history": [{"step": 0, "weights": {"gsm8k": 0.5, "noisy": 0.5}}]}
    if method == "uniform":
        r["model_dir"] = f"{work}/uniform-s{seed}/final"
    return r


def test_run_all_trains_uniform_first_and_hands_its_model_to_doremi():
    lines = []
    cfg = {"seeds": 2, "steps": 4}
    runs = H.run_all(cfg, ["doremi", "hgms", "uniform"], {}, "w", {}, run=_fake_run, log=lines.append)
    assert list(runs) == ["uniform", "hgms", "doremi"]  # METHODS order, not the order asked
    assert [r["reference"] for r in runs["doremi"]] == ["w/uniform-s0/final", "w/uniform-s1/final"]
    assert all("model_dir" not in r and r["steps"] == 4 for rs in runs.values() for r in rs)
    assert len(lines) == 6 and lines[0].startswith("uniform seed 0: heldout_loss 1.0000")
    lines.clear()
    H.run_all(cfg, ["doremi"], {}, "w", {}, run=_fake_run, log=lines.append)
    assert "trains its own uniform reference" in lines[0]


def test_saved_runs_resume_split_invocations_and_keep_doremis_reference(tmp_path):
    from llmkit.experiments.harness import ResultStore

    cfg = {"seeds": 2, "steps": 4}
    store = ResultStore(tmp_path / "parts", cfg)
    trained = []

    def run(method, *a):
        trained.append((method, a[-2]))
        return _fake_run(method, *a)

    work = tmp_path / "w"
    (work / "uniform-s1" / "final").mkdir(parents=True)  # seed 1's uniform model is on disk, seed 0's is not
    quiet = lambda *_: None
    runs = H.run_all(cfg, H.METHODS, {}, work, {}, run=run, log=quiet, store=store, train=["uniform"])
    assert trained == [("uniform", 0), ("uniform", 1)] and H.missing_runs(runs, cfg) == [
        "hgms-s0", "hgms-s1", "doremi-s0", "doremi-s1", "doge-s0", "doge-s1", "odm-s0", "odm-s1"]
    assert sorted(f.name for f in (tmp_path / "parts").glob("*.json")) == ["uniform-s0.json", "uniform-s1.json"]
    trained.clear()
    runs = H.run_all(cfg, ["uniform", "doremi"], {}, work, {}, run=run, log=quiet, store=store,
                     train=["uniform", "doremi"])
    assert trained == [("doremi", 0), ("doremi", 1)]  # the saved uniform runs are not retrained
    # a saved uniform run hands DoReMi its model only where the model is still on disk
    assert [r["reference"] for r in runs["doremi"]] == [None, str(work / "uniform-s1" / "final")]
    assert H.missing_runs(runs, cfg) == [] and runs["uniform"][1]["heldout_loss"] == 1.01
    trained.clear()  # one method's seeds split over invocations: each trains only the seed it is given
    split = ResultStore(tmp_path / "split", cfg)
    runs = H.run_all(cfg, ["hgms"], {}, work, {}, run=run, log=quiet, store=split, train_seeds=[1])
    assert trained == [("hgms", 1)] and H.missing_runs(runs, cfg) == ["hgms-s0"]
    runs = H.run_all(cfg, ["hgms"], {}, work, {}, run=run, log=quiet, store=split, train_seeds=[0])
    assert trained == [("hgms", 1), ("hgms", 0)] and H.missing_runs(runs, cfg) == []
    assert [r["seed"] for r in runs["hgms"]] == [0, 1]
    other = ResultStore(tmp_path / "parts", dict(cfg, steps=5))  # another configuration sees nothing saved
    assert H.missing_runs(H.run_all(cfg, ["uniform"], {}, work, {}, run=run, log=quiet, store=other, train=[]),
                          cfg) == ["uniform-s0", "uniform-s1"]


def test_summarize_means_intervals_ratios_and_paired_differences(tmp_path):
    cfg = {"seeds": 2, "steps": 4}
    runs = H.run_all(cfg, ["uniform", "hgms", "doremi"], {}, "w", {}, run=_fake_run, log=lambda *_: None)
    s = H.summarize(runs, cfg, log=lambda *_: None)
    assert s["heldout_loss_hgms"] == pytest.approx(0.905)
    lo, hi = s["heldout_loss_hgms_ci"]
    assert lo < 0.9 and hi > 0.91
    # hgms - uniform is -0.1 for both seeds: the paired interval collapses on it
    assert s["heldout_loss_diff_hgms_vs_uniform"] == pytest.approx(-0.1)
    assert s["heldout_loss_diff_hgms_vs_uniform_ci"] == pytest.approx([-0.1, -0.1])
    assert s["step_time_ratio_hgms"] == pytest.approx(1.0) == s["overhead_ratio_vs_uniform"]
    assert s["in_run_overhead_ratio_hgms"] == pytest.approx(10 / 8)
    assert s["final_weights_uniform"] == pytest.approx({"gsm8k": 0.6, "noisy": 0.35})
    assert s["doremi_reference_cost_steps"] == 4 and "heldout_accuracy_uniform" not in s
    assert s["refused_share_hgms"] == 0.25 and s["refused_share_doremi"] == 0 and "refused_share_uniform" not in s
    H.plot(runs, s, tmp_path / "h.png", "title")
    assert (tmp_path / "h.png").stat().st_size > 10_000
    alone = H.summarize({"hgms": runs["hgms"]}, cfg, log=lambda *_: None)  # no uniform: no ratios
    assert not any(k.startswith(("step_time_ratio", "heldout_loss_diff")) for k in alone)


def test_the_committed_runs_give_the_committed_summary(repo_root):
    committed = json.loads((repo_root / "bench" / "results" / "hgms_quick.json").read_text())
    s = H.summarize(committed["methods"], committed["config"], log=lambda *_: None)
    assert list(s) == list(committed["summary"])
    for k, v in committed["summary"].items():
        assert json.loads(json.dumps(s[k])) == pytest.approx(v, rel=1e-9, abs=1e-12), k
