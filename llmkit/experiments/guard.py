"""Cross-source evaluation of the AEO guard's scores: fit on one injection source, test on others it never saw.

A guard that users deploy meets traffic unlike its fitting data, so each score is judged
where it was not fitted, as TaskTracker evaluates its probes across injection sources.

Sources (:func:`sources_of`): IHEval's ``safety`` tasks (user-prompt hijack, system-prompt
extraction), its ``rules`` (rule-following) and ``tools`` (tool-use) tasks, ``iheval`` (all
three) and ``gsm8k`` (the GSM8K secret-word set of :mod:`llmkit.serving.guard.injection`).
The pairs (:data:`PAIRS`): safety -> rules, safety -> tools, iheval -> gsm8k, and the
reverse directions.

For each pair and each score (energy, entropic, probe, combined: :data:`SCORES`) a guard is
fitted on the fitting source's labelled answers alone (:func:`fit_guards`: a random
``calibration`` share of its compliant answers, and of its violations, is held out to
calibrate the score, combine the supervised ones and set the threshold at ``target_fpr``),
then scores the test source's answers. Reported per pair and score: the AUROC with a
stratified bootstrap interval (:func:`llmkit.serving.guard.evaluation.auroc_ci`), and the
realized false-positive rate, the share of the test source's compliant answers (clean
answers the guard never saw) above the threshold fitted for ``target_fpr``.

The default score (:func:`choose_default`) is the one with the best worst-case AUROC over
the pairs on which every score could be evaluated (a supervised score cannot be fitted on
a source without violations; a test source needs both kinds for an AUROC).
"""

from __future__ import annotations

import math
import random

from llmkit.serving.guard.score import SCORES

PAIRS = (("safety", "rules"), ("safety", "tools"), ("iheval", "gsm8k"),
         ("rules", "safety"), ("tools", "safety"), ("gsm8k", "iheval"))
_IHEVAL_SOURCES = {"safety": "safety", "rule-following": "rules", "tool-use": "tools"}


def sources_of(dataset: str, task: str) -> set[str]:
    """The source names an answer belongs to: ``{"iheval", "safety"|"rules"|"tools"}`` or ``{"gsm8k"}``.

    ``task`` is ``"<category>/<task>"`` for IHEval (``"safety/user-prompt-hijack"``).
    """
    if dataset == "iheval":
        category = task.split("/", 1)[0]
        if category not in _IHEVAL_SOURCES:
            return {"iheval"}
        return {"iheval", _IHEVAL_SOURCES[category]}
    if dataset.startswith("gsm8k"):
        return {"gsm8k"}
    raise ValueError(f"unknown answer source '{dataset}' (expected iheval or gsm8k_inject)")


def fit_guards(caps: list, labels: list, rows: list[int], *, scores=SCORES, calibration: float = 0.3,
               seed: int = 0, **fit_kw) -> tuple[dict, dict]:
    """Guards of each kind fitted on ``rows`` (indices into ``caps``/``labels``; label 1 violation, 0 compliant,
    None left out). Returns ``(guards, errors)``: a kind that cannot be fitted on these rows (a supervised
    score without violations) is in ``errors`` with the reason. ``fit_kw`` goes to ``Guard.fit_captures``."""
    from llmkit.serving.guard import Guard

    rng = random.Random(seed)
    ok = [i for i in rows if labels[i] == 0]
    bad = [i for i in rows if labels[i] == 1]
    rng.shuffle(ok)
    rng.shuffle(bad)
    n_cal = max(2, int(calibration * len(ok)))
    n_bad_cal = min(max(1, int(calibration * len(bad))), len(bad) - 1) if len(bad) >= 2 else 0
    fit, held = [caps[i] for i in ok[n_cal:]], [caps[i] for i in ok[:n_cal]]
    fit_bad, held_bad = [caps[i] for i in bad[n_bad_cal:]], [caps[i] for i in bad[:n_bad_cal]]
    guards, errors = {}, {}
    for kind in scores:
        try:
            guards[kind] = Guard.fit_captures(fit, held, score=kind, fit_violations=fit_bad,
                                              held_violations=held_bad, **fit_kw)
        except ValueError as e:
            errors[kind] = str(e)
    return guards, errors


def cross_source(caps: list, labels: list, sources: list[set[str]], *, pairs=PAIRS, scores=SCORES,
                 target_fpr: float = 0.05, calibration: float = 0.3, seed: int = 0, n_resamples: int = 1000,
                 progress=None, **fit_kw) -> dict:
    """Fit on one source, test on another, for every pair and score.

    ``caps``: one capture per answer; ``labels``: 1 violation, 0 compliant, None left out;
    ``sources``: each answer's source names (:func:`sources_of`). Returns ``{"pairs": {"<fit>_to_<test>":
    {score: {"auroc", "low", "high", "n_pos", "n_neg", "realized_fpr", "threshold"} | {"error"}}},
    "figures": {...}, "default_score", "comparable_pairs"}``; figures hold ``auroc_cross_<fit>_to_<test>_<score>``,
    ``realized_fpr_cross_<fit>_to_<test>_<score>``, ``realized_fpr_<score>`` (mean over the pairs) and
    ``worst_cross_auroc_<score>``. ``fit_kw`` goes to ``Guard.fit_captures`` (model_name, hidden_size, ...).
    """
    from llmkit.serving.guard.evaluation import auroc_ci, realized_fpr

    if not len(caps) == len(labels) == len(sources):
        raise ValueError(f"caps, labels and sources differ in length: {len(caps)}, {len(labels)}, {len(sources)}")
    out: dict = {"pairs": {}, "figures": {}}
    for a, b in pairs:
        fit_rows = [i for i, s in enumerate(sources) if a in s and b not in s and labels[i] is not None]
        test_rows = [i for i, s in enumerate(sources) if b in s and a not in s and labels[i] is not None]
        name = f"{a}_to_{b}"
        if progress:
            progress(f"cross-source {name}: fit on {len(fit_rows)} answers, test on {len(test_rows)}")
        guards, errors = fit_guards(caps, labels, fit_rows, scores=scores, calibration=calibration, seed=seed,
                                    target_fpr=target_fpr, **fit_kw) if fit_rows else ({}, {})
        y = [labels[i] for i in test_rows]
        per = {}
        for kind in scores:
            if kind not in guards:
                per[kind] = {"error": errors.get(kind, f"no labelled answers in source '{a}'"),
                             "auroc": float("nan")}
            else:
                g = guards[kind]
                s = g.score_captures([caps[i] for i in test_rows]).tolist()
                per[kind] = auroc_ci(s, y, n_resamples=n_resamples, seed=seed)
                clean = [v for v, yy in zip(s, y) if yy == 0]
                per[kind]["realized_fpr"] = realized_fpr(clean, g.threshold) if clean else float("nan")
                per[kind]["threshold"] = g.threshold
            out["figures"][f"auroc_cross_{name}_{kind}"] = per[kind]["auroc"]
            out["figures"][f"realized_fpr_cross_{name}_{kind}"] = per[kind].get("realized_fpr", float("nan"))
        out["pairs"][name] = per
    comparable = [p for p, per in out["pairs"].items() if all(_finite(per[k]["auroc"]) for k in scores)]
    for kind in scores:
        fprs = [out["pairs"][p][kind].get("realized_fpr", float("nan")) for p in out["pairs"]]
        fprs = [f for f in fprs if _finite(f)]
        out["figures"][f"realized_fpr_{kind}"] = sum(fprs) / len(fprs) if fprs else float("nan")
        aucs = [out["pairs"][p][kind]["auroc"] for p in comparable]
        out["figures"][f"worst_cross_auroc_{kind}"] = min(aucs) if aucs else float("nan")
    out["comparable_pairs"] = comparable
    out["default_score"] = choose_default({k: out["figures"][f"worst_cross_auroc_{k}"] for k in scores})
    out["figures"]["target_fpr_cross"] = target_fpr
    return out


def choose_default(worst_auroc: dict[str, float]) -> str:
    """The score with the best worst-case cross-source AUROC (undefined ones last; ties go to the earlier
    score in :data:`SCORES` order, the one that needs less labelled data)."""
    if not worst_auroc:
        raise ValueError("no scores to choose the default from")
    order = list(worst_auroc)
    return max(order, key=lambda k: (worst_auroc[k] if _finite(worst_auroc[k]) else -math.inf, -order.index(k)))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def summary_lines(result: dict) -> list[str]:
    """One printed line per pair and score, then the default and each score's worst case and realized FPR."""
    lines = []
    for name, per in result["pairs"].items():
        for kind, r in per.items():
            if "error" in r:
                lines.append(f"cross-source {name:18s} {kind:9s}: not fitted ({r['error']})")
            else:
                lines.append(f"cross-source {name:18s} {kind:9s}: AUROC {r['auroc']:.3f} [{r['low']:.3f}, "
                             f"{r['high']:.3f}] ({r['n_pos']} violations, {r['n_neg']} compliant)  realized FPR "
                             f"{r['realized_fpr']:.3f} at the threshold fitted for "
                             f"{result['figures']['target_fpr_cross']:.2f}")
    f = result["figures"]
    kinds = [k[len("worst_cross_auroc_"):] for k in f if k.startswith("worst_cross_auroc_")]
    lines.append("cross-source worst-case AUROC over " + ", ".join(result["comparable_pairs"]) + ": "
                 + "  ".join(f"{k} {f['worst_cross_auroc_' + k]:.3f}" for k in kinds))
    lines.append("cross-source realized FPR (mean over pairs): "
                 + "  ".join(f"{k} {f['realized_fpr_' + k]:.3f}" for k in kinds))
    d = result["default_score"]
    lines.append(f"default score by best worst-case cross-source AUROC: {d} (worst case "
                 f"{f['worst_cross_auroc_' + d]:.3f}, realized FPR {f['realized_fpr_' + d]:.3f} at target "
                 f"{f['target_fpr_cross']:.2f})")
    return lines
