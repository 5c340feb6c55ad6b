"""bench/optim.py's figures (llmkit.experiments.optim) from synthetic runs, and the test counter both optim
benches use."""

from __future__ import annotations

import pytest

from llmkit.experiments import optim as O


def _vspo(agg: str, step_s: float, cos: float) -> dict:
    return {"aggregation": agg, "step_s": step_s, "curves": {
        "rewards/verbosity/mean": [0.5, 0.25], "rewards/expertise/mean": [0.1, 0.3],
        "rewards/verbosity/group_spread": [1.0, 0.5], "rewards/expertise/group_spread": [0.0, 1.0],
        "reward_conflict/verbosity__expertise/cos": [cos, cos], "reward_conflict/verbosity__expertise/frac_opposed":
            [0.5, 1.0], **({"jd/weight/verbosity": [0.4, 0.6]} if agg == "upgrad" else {})}}


def test_halo_ratios_are_against_the_first_run():
    halo = [{"label": "AdamW", "eval_loss": 2.0, "step_s": 4.0}, {"label": "Muon", "eval_loss": 1.8, "step_s": 5.0},
            {"label": "Lion", "eval_loss": 2.2, "step_s": 4.0}]
    assert O.halo_ratios(halo) == pytest.approx({
        "muon_vs_adamw_eval_loss_ratio": 0.9, "muon_vs_adamw_step_time_ratio": 1.25,
        "lion_vs_adamw_eval_loss_ratio": 1.1, "lion_vs_adamw_step_time_ratio": 1.0})


def test_vspo_summary_and_the_last_line():
    s = O.vspo_summary([_vspo("sum", 2.0, -0.5), _vspo("upgrad", 3.0, -0.25)])
    assert s["upgrad_step_time_ratio"] == 1.5
    assert s["reward_means"]["sum"] == {"verbosity": [0.5, 0.25], "expertise": [0.1, 0.3]}
    assert s["reward_group_spread"]["upgrad"] == {"verbosity": 0.75, "expertise": 0.5}
    assert s["reward_conflict_cos"] == {"sum": -0.5, "upgrad": -0.25}
    assert s["reward_conflict_frac_opposed"]["sum"] == 0.75
    assert O.upgrad_weights(_vspo("upgrad", 1, 0)["curves"]) == {"verbosity": [0.4, 0.6]}
    line = O.summary({**s, "muon_vs_adamw_eval_loss_ratio": 0.9, "toys": {"passed": 3, "total": 4}})
    assert list(line) == [*O.SUMMARY_KEYS, *O.REWARD_KEYS, "toy_tests_passed", "toy_tests_total"]
    assert line["toy_tests_passed"] == 3 and line["lion_vs_adamw_eval_loss_ratio"] is None
    assert O.summary({})["toy_tests_total"] is None  # --skip-toys


def test_metric_curves_keep_the_named_series_without_std():
    recs = [{"rewards/a/mean": 1.0, "rewards/a/std": 0.1, "loss": 3.0, "jd/weight/a": 0.5}, {"rewards/a/mean": 2.0}]
    assert O.metric_curves(recs) == {"rewards/a/mean": [1.0, 2.0], "jd/weight/a": [0.5, None]}


def test_plot_writes_a_png(tmp_path):
    halo = [{"label": "AdamW", "eval_loss": 2.0, "step_s": 4.0, "steps": 2},
            {"label": "Muon", "eval_loss": 1.8, "step_s": 5.0, "steps": 2}]
    O.plot({"halo": halo, "vspo": [_vspo("sum", 2.0, -0.5), _vspo("upgrad", 3.0, -0.2)],
            "upgrad_step_time_ratio": 1.5}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_run_test_files_counts_passed_and_names_the_rest(tmp_path):
    (tmp_path / "tests" / "deep").mkdir(parents=True)
    (tmp_path / "tests" / "test_optim_a.py").write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
        "@pytest.mark.skip\ndef test_skipped():\n    pass\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n")
    (tmp_path / "tests" / "deep" / "test_optim_b.py").write_text("def test_fine():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    files = O.find_test_files(tmp_path, ["a", "b"])
    assert files == ["tests/test_optim_a.py", "tests/deep/test_optim_b.py"]
    res = O.run_test_files(tmp_path, files, marker="not slow")
    assert res["passed"] == 2 and res["total"] == 4
    assert sorted(n.split("::")[-1] for n in res["not_passed"]) == ["test_bad", "test_skipped"]
    with pytest.raises(FileNotFoundError, match="test_optim_c.py"):
        O.find_test_files(tmp_path, ["c"])
