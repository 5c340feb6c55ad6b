"""bench/optim_structured.py's figures (llmkit.experiments.optim_structured) at toy sizes; the VSPO part on
synthetic metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmkit.experiments import optim_structured as OS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_locu_figures_rates_and_collinear_steps():
    res = OS.locu_figures(seeds=2, steps=60)
    for k in ("locu_feasible_rate", "penalty1_feasible_rate", "penalty2_feasible_rate"):
        assert 0.0 <= res[k] <= 1.0
    assert res["collinear_step_over_radius_locu_max"] <= 1.0 + 1e-9  # LOCU stays inside its trust region
    assert all(math.isfinite(res[k]) for k in ("locu_final_reward", "penalty1_final_reward"))


def test_dro_figures_without_gsm8k(tmp_path):
    # no train.jsonl in tmp_path: that part is left out
    res = OS.dro_figures(quick=True, gsm8k=tmp_path, toy_seeds=1, toy_n=(300, 2000), folds=2)
    for group in ("toy", "diabetes"):
        assert {f"{group}_tail_mse_{m}" for m in ("erm", "chi2", "tc_dro", "wasserstein")} <= set(res)
    assert not any(k.startswith("gsm8k") for k in res)
    assert all(v > 0 for v in res.values())


def test_io_figures_error_falls_with_more_demonstrations():
    res = OS.io_figures(quick=True, Ts=[25, 400], reps=2, n_test=300)
    assert set(res["io_errors_by_T"]) == {25, 400} and res["io_heldout_error"] == res["io_errors_by_T"][400]
    assert res["io_log_slope"] < 0
    assert res["pref_cosine"] > 0.9 and res["pref_heldout_agreement"] >= res["pref_uniform_agreement"]


def test_tensor_and_matrix_figures():
    t = OS.tensor_figures(seeds=1)
    assert t["rgn_vs_rgd_iters_ratio"] > 0 and set(t["tensor_error_curves_seed0"]) == {"rgn", "rgd"}
    m = OS.mc_figures(seeds=1)
    assert m["mc_relative_error"] == m["mc_relative_error_eps0.001"] < 0.1


def test_locu_vspo_figures_from_logged_metrics(monkeypatch, tmp_path):
    def fake_run(config, out, extra):
        locu = "locu" in extra
        words = [30.0, 18.0, 15.0, 12.0] if locu else [30.0, 28.0, 19.0, 25.0]
        return [{"vspo/mean_words": w, "rewards/gsm8k_correctness/mean": 0.25 * i,
                 **({"locu/step_norm": 0.05, "locu/active": float(w > 20)} if locu else {})}
                for i, w in enumerate(words)]

    monkeypatch.setattr(OS, "_vspo_run", fake_run)
    res = OS.locu_vspo_figures(tmp_path / "unused.yaml", quick=True, max_words=20.0)
    assert res["vspo_locu_steps"] == 4 and res["vspo_locu_max_completion_length"] == 48
    assert res["vspo_locu_constraint_satisfaction"] == 0.75 and res["vspo_penalty_constraint_satisfaction"] == 0.25
    assert res["vspo_locu_final_task_reward"] == pytest.approx(0.625)  # mean over the last half of the steps
    assert res["vspo_locu_step_norm_max"] == 0.05 and res["vspo_locu_active_rate"] == 0.25
    assert res["vspo_penalty_final_mean_words"] == 25.0


def test_plot_writes_a_png(tmp_path):
    res = {"io_errors_by_T": {25: 0.2, 400: 0.02}, "tensor_error_curves_seed0": {"rgn": [1, 0.1], "rgd": [1, 0.5]},
           **{f"mc_relative_error_eps{e:g}": e for e in (0.1, 0.01, 0.001)}}
    for g in ("toy", "diabetes", "gsm8k_difficulty"):
        res.update({f"{g}_tail_mse_{m}": v for m, v in (("erm", 1.0), ("chi2", 0.9), ("tc_dro", 0.8))})
    OS.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert np.isfinite(res["toy_tail_mse_erm"])
