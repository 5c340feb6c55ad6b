"""bench/select.py's figures (llmkit.experiments.selection) at toy sizes, and the select replay with a stub
engine in place of the bundled model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.experiments import selection as S

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bandit_figures_top_two_beats_uniform():
    res = S.bandit_figures(seeds=4)
    assert 0 <= res["tci_correct_rate"] <= 1 and res["t_star"] > 0
    assert res["tci_samples_vs_uniform"] == pytest.approx(res["tci_mean_samples"] / res["uniform_mean_samples"])
    assert set(res["tci_tau_vs_tstar_log"]) == {"0.001", "1e-12"}


def test_bisection_figures():
    res = S.bisection_figures(seeds=1)
    assert 0 <= res["bisection_success_rate"] <= 1
    assert set(res["bisection_mean_evals"]) == {"quadratic", "abs", "exp", "boundary"}


def test_es_figures_at_toy_sizes():
    sphere = {"n": 8, "p": 1, "budget": 150, "sigma0": 0.05, "target": 0.95}
    stiefel = {"n": 6, "p": 2, "budget": 150, "sigma0": 0.05, "target": 0.95}
    res = S.es_figures(2, sphere=sphere, stiefel=stiefel, sweep_sizes=[(6, 1, 100)])
    assert res["es_setting"]["sphere"] == sphere
    assert {"es_sphere_success_rate", "es_sphere_evals_vs_cma", "es_stiefel_evals_vs_euclidean"} <= set(res)
    shares = [e["normal_share"] for e in res["es_ratio_by_normal_share"]]
    assert len(shares) == 3 and shares == sorted(shares)
    assert S.manifold_label({"n": 8, "p": 1}) == "S^7" and S.manifold_label({"n": 6, "p": 2}) == "St(6,2)"


def test_bo_figures_small_budget():
    res = S.bo_figures(1, budget=8)
    assert set(res["bts_vs_random_by_function"]) == {"branin", "hartmann3"} and res["bts_vs_random_regret_ratio"] > 0


def test_replay_selection_on_a_clear_winner():
    rng = np.random.default_rng(0)
    table = np.stack([rng.random(200) < p for p in (0.9, 0.3, 0.2)]).astype(float)
    res = S.replay_selection(table, lookahead=8, seeds=3)
    assert res["select_winner_match_rate"] == 1.0 and res["select_stopped_rate"] == 1.0
    assert 0 < res["select_evals_vs_full_no_lookahead"] <= res["select_evals_vs_full"] < 1
    assert res["select_lookahead"] == 8 and res["select_example_run"]["winner"] == 0


def test_select_figures_with_a_stub_engine(shared_data):
    from llmkit.experiments.ldp_cache.workload import load_arith_problems
    from llmkit.generation import Completion

    data = shared_data / "gsm8k" / "train.jsonl"
    gold = {p["question"]: p["gold"] for p in load_arith_problems(data, 12, seed=0)}

    class Stub:  # the 64-token arm answers right, the others wrong
        def chat_prompt(self, msgs):
            return json.dumps(msgs)

        def generate(self, prompts, params, n=1, progress=False):
            def answer(p):
                q = next(q for q in gold if q in json.loads(p)[-1]["content"])
                return f"#### {gold[q]}" if params.max_new_tokens == 64 else "#### -1"
            return [[Completion(answer(p), 1, 1, "stop")] for p in prompts]

        def close(self):
            pass

    res = S.select_figures(data, 12, seeds=2, engine_factory=lambda model, **kw: Stub())
    acc = list(res["select_full_accuracy"].values())
    assert acc == [1.0, 0.0, 0.0] and res["select_winner_match_rate"] == 1.0 and res["select_problems"] == 12
    assert res["select_lookahead"] >= 1 and list(res)[-1] == "select_example_run"


def test_summary_and_plot(tmp_path):
    res = {"tci_correct_rate": 1.0, "select_evals_vs_full": None, "select_lookahead": 8,
           "es_ratio_by_normal_share": [{"n": 8, "p": 1, "normal_share": 0.125, "evals_vs_euclidean": 0.9}]}
    line = S.summary(res)
    assert list(line) == [*S.SUMMARY_KEYS, "select_lookahead"] and line["bisection_success_rate"] is None
    S.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
