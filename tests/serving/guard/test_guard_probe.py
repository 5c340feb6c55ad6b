"""Supervised guard scores a user can fit and serve: probe and combined, from `llmkit guard fit --score`."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from llmkit.experiments.stats import auroc
from llmkit.serving.guard import Guard
from llmkit.serving.guard.probe import LinearProbe


def labelled(tutor, n: int, seed: int) -> tuple[list[list[dict]], list[bool]]:
    """Compliant answers to plain and injected prompts, and violating answers to injected prompts."""
    plain = tutor.items(n, seed, injected=False)
    inj = tutor.items(n, seed + 100)
    convs = [tutor.conv(x["prompt"], x["compliant"]) for x in plain + inj]
    convs += [tutor.conv(x["prompt"], x["violating"]) for x in inj]
    return convs, [False] * (2 * n) + [True] * n


def test_linear_probe_equals_sklearn_and_roundtrips():
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6)) * [1, 10, 0.1, 1, 1, 3]
    y = (x[:, 0] + 0.1 * x[:, 1] + rng.normal(size=80) > 0).astype(int)
    probe = LinearProbe.fit(x, y, C=0.5)
    ref = make_pipeline(StandardScaler(), LogisticRegression(C=0.5, max_iter=5000, class_weight="balanced",
                                                             random_state=0)).fit(x, y)
    np.testing.assert_allclose(probe.decision(x).numpy(), ref.decision_function(x), rtol=1e-6, atol=1e-6)
    back = LinearProbe.from_tensors(probe.tensors("p"), "p")
    np.testing.assert_allclose(back.decision(x).numpy(), ref.decision_function(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="both compliant and violating"):
        LinearProbe.fit(x, np.zeros(80))


@pytest.mark.parametrize("kind", ["probe", "combined"])
def test_supervised_guard_fits_saves_and_serves_like_the_others(kind, tiny_model, tiny_tokenizer, tutor, tmp_path):
    from llmkit.commands.serve import load_guard
    from llmkit.engines.hf import HFEngine

    convs, labels = labelled(tutor, 16, 0)
    guard = Guard.fit(tiny_model, tiny_tokenizer, convs, labels=labels, model_name="tiny", layers=[1, 2],
                      n_components=8, target_fpr=0.1, score=kind)
    assert guard.meta["score"] == kind and guard.meta["n_fit_violations"] > 0 and guard.meta["holdout_fpr"] <= 0.1
    guard.save(tmp_path / "g")
    served = load_guard(argparse.Namespace(guard=str(tmp_path / "g")), "tiny")  # what `llmkit serve --guard` does
    assert served.score_kind == kind and served.threshold == pytest.approx(guard.threshold)
    test_convs, test_labels = labelled(tutor, 12, 50)
    scores = served.score(tiny_model, tiny_tokenizer, test_convs)
    assert scores == pytest.approx(guard.score(tiny_model, tiny_tokenizer, test_convs), rel=1e-4, abs=1e-4)
    assert auroc(scores, test_labels) > 0.9
    engine = HFEngine(tiny_model, tiny_tokenizer)
    bad, ok = test_convs[-1], test_convs[12]  # a violating and a compliant answer to injected prompts
    r_bad, r_ok = (served.check(engine, c[:-1], c[-1]["content"]) for c in (bad, ok))
    assert r_bad["score"] > r_ok["score"] and set(r_bad) >= {"score", "flagged", "threshold", "layer_scores"}
    assert isinstance(r_bad["flagged"], bool) and set(r_bad["layer_scores"]) == {"1", "2"}


def test_supervised_scores_refuse_data_without_violations(tiny_model, tiny_tokenizer, tutor):
    convs, labels = labelled(tutor, 8, 0)
    only_ok = [c for c, y in zip(convs, labels) if not y]
    for kind in ("probe", "combined"):
        with pytest.raises(ValueError, match=f"the '{kind}' score learns from both kinds"):
            Guard.fit(tiny_model, tiny_tokenizer, only_ok, model_name="tiny", layers=[1, 2], score=kind)
    # the unsupervised scores fit on the compliant ones and leave the violations out
    g = Guard.fit(tiny_model, tiny_tokenizer, convs, labels=labels, model_name="tiny", layers=[1, 2],
                  n_components=4, score="energy")
    assert g.meta["n_fit"] + g.meta["n_holdout"] == len(only_ok) and g.meta["n_fit_violations"] == 0


def test_cli_fit_probe_from_labelled_lines(tiny_model, tiny_tokenizer, tutor, tmp_path, capsys):
    from llmkit.cli import main

    folder = tmp_path / "tiny-model"
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    convs, labels = labelled(tutor, 12, 0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": c, "violation": y}) + "\n" for c, y in zip(convs, labels)))
    common = ["guard", "fit", "--model", str(folder), "--layers", "1,2", "--components", "4"]
    assert main([*common, "--data", str(data), "--out", str(tmp_path / "g"), "--score", "probe"]) == 0
    out = capsys.readouterr().out
    assert "probe guard fitted on" in out and "held-out AUROC" in out
    assert json.loads((tmp_path / "g" / "guard.json").read_text())["score"] == "probe"
    # scoring with the fitted probe is the ordinary `guard score`
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs[-4:]))
    assert main(["guard", "score", "--guard", str(tmp_path / "g"), "--input", str(inp),
                 "--output", str(tmp_path / "out.jsonl")]) == 0
    assert all(isinstance(json.loads(l)["flagged"], bool) for l in (tmp_path / "out.jsonl").read_text().splitlines())

    # energy leaves the violating lines out and says so
    assert main([*common, "--data", str(data), "--out", str(tmp_path / "e")]) == 0
    assert "12 lines marked \"violation\": true left out" in capsys.readouterr().out
    # probe and combined need both kinds: one clear line
    ok_only = tmp_path / "ok.jsonl"
    ok_only.write_text("".join(json.dumps({"messages": c, "violation": False}) + "\n"
                               for c, y in zip(convs, labels) if not y))
    for kind in ("probe", "combined"):
        assert main([*common, "--data", str(ok_only), "--out", str(tmp_path / "x"), "--score", kind]) == 2
        err = capsys.readouterr().err
        assert f"--score {kind} learns from violations too" in err and "found 0 violating, 24 compliant" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": convs[0], "violation": "yes"}) + "\n")
    assert main([*common, "--data", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert f"{bad}:1: 'violation' must be true or false" in capsys.readouterr().err


def test_probe_guard_scores_every_window(tiny_model, tiny_tokenizer, tutor):
    # a late violation in a long answer: the probe is maximised over windows too
    convs, labels = labelled(tutor, 16, 0)
    guard = Guard.fit(tiny_model, tiny_tokenizer, convs, labels=labels, model_name="tiny", layers=[1, 2],
                      n_components=8, score="probe")
    prompt = tutor.items(1, 7)[0]["prompt"]
    long_ok = " ".join(tutor.solution(a, a + 1, 3) for a in range(10, 22))
    late_answer = long_ok + " " + tutor.items(1, 5)[0]["violating"]
    ok, late = guard.score(tiny_model, tiny_tokenizer, [tutor.conv(prompt, long_ok), tutor.conv(prompt, late_answer)])
    assert late > guard.threshold > ok
    assert torch.isfinite(torch.tensor([ok, late])).all()
