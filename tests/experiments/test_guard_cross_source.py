"""Cross-source evaluation (llmkit.experiments.guard): fit on one source, test on sources never seen."""

from __future__ import annotations

import math

import pytest
import torch

from llmkit.experiments import guard as X
from llmkit.serving.guard import Capture

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASKS = {"safety": ("iheval", "safety/user-prompt-hijack"), "rules": ("iheval", "rule-following/single-turn"),
         "tools": ("iheval", "tool-use/get-webpage"), "gsm8k": ("gsm8k_inject", "gsm8k/secret-word")}


def synthetic(n_per: int = 24, d: int = 16, seed: int = 0, no_violations_in=(), no_compliant_in=()):
    """Answers from four sources: each source has its own compliant centre; violations of every source
    drift along one shared direction (what a guard that transfers must pick up). A source in
    ``no_compliant_in`` has violations and unlabelled answers only (a task the model never does)."""
    g = torch.Generator().manual_seed(seed)
    drift = torch.zeros(d)
    drift[0] = 6.0
    caps, labels, sources = [], [], []
    for name, (dataset, task) in TASKS.items():
        centre = torch.randn(d, generator=g) * 2
        for k in range(n_per):
            y = int(k % 3 == 0 and name not in no_violations_in)
            t = 4 + k % 5
            x = centre + torch.randn(t, d, generator=g) + (drift if y else 0)
            caps.append(Capture(states={1: x.float(), 2: (2 * x).float()}, n_tokens=t))
            labels.append(None if name in no_compliant_in and not y else y)
            sources.append(X.sources_of(dataset, task))
    return caps, labels, sources


FIT = {"model_name": "synthetic", "hidden_size": 16, "num_layers": 2, "n_components": 4}


def test_sources_of_names_every_source():
    assert X.sources_of("iheval", "safety/system-prompt-extract") == {"iheval", "safety"}
    assert X.sources_of("iheval", "rule-following/single-turn") == {"iheval", "rules"}
    assert X.sources_of("iheval", "tool-use/slack-user") == {"iheval", "tools"}
    assert X.sources_of("gsm8k_inject", "gsm8k/secret-word") == {"gsm8k"}
    with pytest.raises(ValueError, match="unknown answer source 'mmlu'"):
        X.sources_of("mmlu", "x")


def test_cross_source_reports_every_pair_and_score():
    caps, labels, sources = synthetic()
    res = X.cross_source(caps, labels, sources, n_resamples=50, **FIT)
    f = res["figures"]
    for a, b in X.PAIRS:
        for kind in X.SCORES:
            auc = f[f"auroc_cross_{a}_to_{b}_{kind}"]
            assert 0.0 <= auc <= 1.0
            r = res["pairs"][f"{a}_to_{b}"][kind]
            assert r["low"] <= auc <= r["high"] and r["n_pos"] > 0 and r["n_neg"] > 0
            assert 0.0 <= r["realized_fpr"] <= 1.0
    for kind in X.SCORES:
        assert 0.0 <= f[f"realized_fpr_{kind}"] <= 1.0
    # iheval -> gsm8k fits on the three IHEval sources and tests on GSM8K only
    n_gsm = sum(1 for s in sources if s == {"gsm8k"})
    r = res["pairs"]["iheval_to_gsm8k"]["energy"]
    assert r["n_pos"] + r["n_neg"] == n_gsm
    # the realized FPR is measured on the test source's clean answers at the threshold fitted on the other source:
    # here each source's compliant answers sit elsewhere, so an unsupervised guard flags nearly all of them
    fit_rows = [i for i, s in enumerate(sources) if "safety" in s and labels[i] is not None]
    test_ok = [i for i, s in enumerate(sources) if "rules" in s and labels[i] == 0]
    guards, _ = X.fit_guards(caps, labels, fit_rows, scores=("energy",), target_fpr=0.05, **FIT)
    g = guards["energy"]
    want = float((g.score_captures([caps[i] for i in test_ok]) > g.threshold).double().mean())
    assert res["pairs"]["safety_to_rules"]["energy"]["realized_fpr"] == pytest.approx(want)
    assert f["realized_fpr_cross_safety_to_rules_energy"] > 0.5 > g.meta["holdout_fpr"]
    assert set(res["comparable_pairs"]) == {f"{a}_to_{b}" for a, b in X.PAIRS} and res["left_out"] == {}
    assert res["sources"]["tools"] == {"violations": 8, "compliant": 16, "unlabelled": 0}
    worst = {k: f[f"worst_cross_auroc_{k}"] for k in X.SCORES}
    assert res["default_score"] == X.choose_default(worst)
    assert worst[res["default_score"]] == max(worst.values())
    lines = X.summary_lines(res)
    assert any(l.startswith("default score by best worst-case cross-source AUROC: ") for l in lines)


def test_a_source_without_violations_cannot_fit_the_supervised_scores():
    caps, labels, sources = synthetic(no_violations_in=("rules",))
    res = X.cross_source(caps, labels, sources, pairs=(("rules", "safety"), ("safety", "tools")),
                         n_resamples=20, **FIT)
    per = res["pairs"]["rules_to_safety"]
    assert "violating examples" in per["probe"]["error"] and math.isnan(per["probe"]["auroc"])
    assert "error" in per["combined"] and not math.isnan(per["energy"]["auroc"])
    # only pairs every score could be evaluated on decide the default
    assert res["comparable_pairs"] == ["safety_to_tools"]
    why = res["left_out"]["rules_to_safety"]
    assert why.startswith("not fitted: probe: ") and "combined: " in why and "energy" not in why


def test_a_source_without_compliant_answers_is_left_out_with_its_counts_and_no_invented_label():
    caps, labels, sources = synthetic(no_compliant_in=("tools",))
    before = list(labels)
    res = X.cross_source(caps, labels, sources, n_resamples=20, **FIT)
    assert labels == before and res["sources"]["tools"] == {"violations": 8, "compliant": 0, "unlabelled": 16}
    assert res["left_out"] == {
        "safety_to_tools": "test source 'tools' has no compliant answer (8 violations, 0 compliant)",
        "tools_to_safety": "fit source 'tools' has no compliant answer (8 violations, 0 compliant)"}
    assert set(res["comparable_pairs"]) == {"safety_to_rules", "iheval_to_gsm8k", "rules_to_safety",
                                            "gsm8k_to_iheval"}
    for kind in X.SCORES:
        assert math.isnan(res["figures"][f"auroc_cross_safety_to_tools_{kind}"])
        assert "error" in res["pairs"]["tools_to_safety"][kind]
        assert res["figures"][f"worst_cross_auroc_{kind}"] == min(
            res["figures"][f"auroc_cross_{p}_{kind}"] for p in res["comparable_pairs"])
    lines = X.summary_lines(res)
    assert "cross-source source tools  : 8 violations, 0 compliant, 16 unlabelled" in lines
    assert ("cross-source tools_to_safety left out of the worst case: fit source 'tools' has no compliant answer "
            "(8 violations, 0 compliant)") in lines


def test_a_test_source_with_a_handful_of_one_class_is_reported_but_not_in_the_worst_case():
    caps, labels, sources = synthetic()
    tools_ok = [i for i, s in enumerate(sources) if "tools" in s and labels[i] == 0]
    for i in tools_ok[2:]:
        labels[i] = None  # two compliant tool-use answers left: one answer swings the AUROC by a half
    res = X.cross_source(caps, labels, sources, pairs=(("safety", "tools"), ("safety", "rules")), n_resamples=20,
                         **FIT)
    r = res["pairs"]["safety_to_tools"]["energy"]
    assert r["n_neg"] == 2 and math.isfinite(r["auroc"])
    assert res["comparable_pairs"] == ["safety_to_rules"]
    assert res["left_out"] == {"safety_to_tools": "test source 'tools' has fewer than 5 answers of a class "
                                                  "(8 violations, 2 compliant)"}
    assert res["figures"]["worst_cross_auroc_energy"] == res["pairs"]["safety_to_rules"]["energy"]["auroc"]
    lenient = X.cross_source(caps, labels, sources, pairs=(("safety", "tools"), ("safety", "rules")),
                             n_resamples=20, min_class=1, **FIT)
    assert lenient["comparable_pairs"] == ["safety_to_tools", "safety_to_rules"]


def test_choose_default_takes_the_best_worst_case():
    assert X.choose_default({"energy": 0.6, "entropic": 0.7, "probe": 0.65, "combined": float("nan")}) == "entropic"
    assert X.choose_default({"energy": 0.7, "entropic": 0.7, "probe": 0.7}) == "energy"  # ties: less data needed
    with pytest.raises(ValueError, match="no scores"):
        X.choose_default({})
