"""Sentences bench/report.py states from a results JSON's own numbers, so a rerun rewrites them.

Each maker takes (data, load) and returns one sentence; ``said`` skips a maker whose
figures the JSON lacks (a quick run records fewer).
"""

from __future__ import annotations

from collections.abc import Callable


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}%"


def sgn(x: float, nd: int = 3) -> str:
    return f"{x:+.{nd}f}"


def ci(pair, nd: int = 3) -> str:
    return f"[{pair[0]:+.{nd}f}, {pair[1]:+.{nd}f}]"


def spans(layers: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    out, start = [], None
    for i, n in enumerate(layers):
        start = n if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n != start else str(n))
            start = None
    return ", ".join(out) or "none"


def said(*makers) -> Callable:
    """Findings from sentence makers; a maker whose figures are missing is skipped."""
    def run(d, load):
        out = []
        for make in makers:
            try:
                out.append(make(d, load))
            except (KeyError, TypeError, IndexError, ZeroDivisionError, ValueError):
                pass
        return out
    return run


# --- InQuant KV cache -------------------------------------------------------------------------------------------
def _kv_best(table: dict) -> str:
    return min((k for k in table if k.startswith("inquant/")), key=table.get)


def _kv_ppl(d, _):
    p, best = d["arms"]["ppl"], _kv_best(d["arms"]["ppl"])
    return (f"GSM8K-solution perplexity vs bf16 ({p['tokens']} tokens): per-token groups with the score gate "
            f"{pct(p['inquant/per-token/score'] / p['bf16'])}, per-token without outliers "
            f"{pct(p['inquant/per-token/none'] / p['bf16'])}; the best InQuant setting on this text is `{best}` "
            f"({pct(p[best] / p['bf16'])}).")


def _kv_long(d, _):
    p, best = d["arms"]["long_ppl"], _kv_best(d["arms"]["long_ppl"])
    return (f"Long context ({p['ctx_len']}-token windows): best `{best}` ({pct(p[best] / p['bf16'])}); "
            f"per-channel without outliers {pct(p['inquant/per-channel/none'] / p['bf16'])}.")


def _kv_off(d, _):
    p = d["arms"]["ppl"]
    return (f"Keeping every outlier pair (gate off) hurts: {pct(p['inquant/per-channel/off'] / p['bf16'])} per channel, "
            f"{pct(p['inquant/per-token/off'] / p['bf16'])} per token.")


def _kv_base(d, _):
    f = d["figures"]
    return (f"Baselines' perplexity vs bf16: KIVI {pct(f['ppl_ratio_kivi'])}, outlier buffer "
            f"{pct(f['ppl_ratio_outlier_buffer'])}, HF quanto {pct(f['ppl_ratio_hf_quanto'])}.")


def _kv_cap(d, _):
    f, c = d["figures"], d["capacity"]
    return (f"{f['capacity_ratio_vs_bf16']:.2f}x as many {c['seq_len']}-token sequences fit in {fmt_n(c['budget_gib'])} "
            f"GiB as with bf16; staggered requests served {f['served_throughput_ratio_vs_bf16']:.2f}x bf16's "
            f"throughput; batched decode (4 prompts, `generate`) runs at {f['decode_ratio_vs_bf16']:.2f}x bf16's speed.")


def fmt_n(x) -> str:
    return f"{x:g}"


# --- AEO guard --------------------------------------------------------------------------------------------------
def _layers(d, part: str, above: bool) -> list[int]:
    per = d["dispersion_per_layer"][part]
    return sorted(int(k) for k, v in per.items() if (v["logdet"]["ratio"] > 1) == above)


def _g_iheval(d, _):
    n = len(d["dispersion_per_layer"]["iheval"])
    return (f"IHEval: violating answers are less dispersed than compliant ones (log-det ratio < 1) at "
            f"{len(_layers(d, 'iheval', False))} of {n} layers; {d['figures']['dispersion_logdet_iheval']:.2f} over "
            f"the guard layers {d['layers']}.")


def _g_gsm8k(d, _):
    per = d["dispersion_per_layer"]["gsm8k_inject"]
    at = ", ".join(f"{k} {per[str(k)]['logdet']['ratio']:.2f}" for k in d["layers"])
    return (f"GSM8K secret-word answers that leak scatter more (log-det ratio > 1) at layers "
            f"{spans(_layers(d, 'gsm8k_inject', True))} and less at {spans(_layers(d, 'gsm8k_inject', False))}; "
            f"at the guard layers: {at}.")


def _g_detect(d, _):
    f, a, p = d["figures"], d["auroc_intervals"]["aeo"], d["auroc_intervals"]["probe"]
    chosen = "" if "default_worst_cross_auroc" in f else f" (default: {f['default_score']})"
    return (f"Out-of-fold AUROC energy {f['cv_auroc_energy']:.3f} vs entropic {f['cv_auroc_entropic']:.3f}{chosen}; "
            f"test AUROC {a['auroc']:.3f} [{a['low']:.3f}, {a['high']:.3f}] on {a['n_pos']} "
            f"violations / {a['n_neg']} compliant, realized FPR {f['realized_fpr']:.3f} for a {f['target_fpr']:.2f} "
            f"target; a supervised probe {p['auroc']:.3f} [{p['low']:.3f}, {p['high']:.3f}].")


def _g_cross(d, _):
    f, k = d["figures"], d["figures"]["default_score"]
    worst = ", ".join(f"{s} {f['worst_cross_auroc_' + s]:.3f}" for s in ("energy", "entropic", "probe", "combined"))
    cut = d["config"].get("compliant_at")
    label = (f"Labels: an answer is compliant when it earns at least {cut:g} of IHEval's per-answer credit (rule-"
             "following: mean of IFEval's prompt- and instruction-level strict and loose checks; get-webpage: mean of "
             "strict and loose ROUGE-L / word F1; pass or fail elsewhere), a violation when a conflict-setting answer "
             "earns less. " if cut is not None else "")
    return label + (f"Fitted on one source and tested on another it never saw ({', '.join(d['cross_source_comparable_pairs'])}), "
            f"the worst-case AUROC is {worst}; the default score is {k} (best worst case, "
            f"{f['default_worst_cross_auroc']:.3f}), with a realized FPR of {f['default_realized_fpr_cross']:.3f} on the "
            f"unseen sources' clean answers at the threshold fitted for a {f['target_fpr_cross']:.2f} target."
            + _g_cross_default_pairs(d) + _g_cross_left_out(d))


def _g_cross_default_pairs(d) -> str:
    """The default score's AUROC (bootstrap interval) and realized FPR on each pair in the worst case."""
    k = d["figures"]["default_score"]
    per = [(name, d["cross_source"][name][k]) for name in d["cross_source_comparable_pairs"]]
    return (f" {k.capitalize()} per pair: " + "; ".join(
        f"{name} AUROC {r['auroc']:.3f} [{r['low']:.3f}, {r['high']:.3f}], realized FPR {r['realized_fpr']:.3f}"
        for name, r in per) + ".") if per else ""


def _g_cross_left_out(d) -> str:
    """The pairs kept out of the worst case and the run's reason for each (a source without a class is named, with
    its counts; a score that could not be fitted says why)."""
    why = [f"{name}: {r}" for name, r in d["cross_source_left_out"].items()]
    return f" Left out of the worst case: {'; '.join(why)}." if why else " Every pair is in the worst case."


def _g_arms(d, _):
    iv = d["iheval_arm_intervals"]
    arm = lambda k: f"{sgn(iv[k]['value'])} {ci((iv[k]['low'], iv[k]['high']))}"
    return (f"On {d['counts']['iheval_test_answers']} held-out IHEval answers, vs no guard: re-prompting flagged "
            f"answers {arm('guard_correct_minus_no_guard')}, latent rectification {arm('latent_correct_minus_no_guard')} "
            f"(its unsteered-continuation control {arm('latent_unsteered_continuation_minus_no_guard')}), regenerating "
            f"every answer with the instruction reasserted {arm('always_regenerate_minus_no_guard')}.")


# --- LDPCache ---------------------------------------------------------------------------------------------------
def _ldp_curve(d, _):
    parts = [f"B/Q {float(b):g}: {sgn(v['ldpcache']['diff_vs_no_cache'])} {ci(v['ldpcache']['diff_vs_no_cache_ci95'])}"
             for b, v in d["pooled"].items()]
    return f"LDPCache minus per-query LDP, accuracy pooled over both workloads ({d['repeats']} seeds): " + "; ".join(parts) + "."


def _ldp_where(d, _):
    pooled = d["pooled"]
    where = {"ahead of": [], "level with": [], "behind": []}
    for b, v in pooled.items():
        lo, hi = v["ldpcache"]["diff_vs_no_cache_ci95"]
        where["ahead of" if lo > 0 else "behind" if hi < 0 else "level with"].append(f"{float(b):g}")
    return "LDPCache is " + "; ".join(f"{k} per-query LDP (interval {'above' if k == 'ahead of' else 'below' if k == 'behind' else 'around'} 0) at B/Q {', '.join(v)}"
                                      for k, v in where.items() if v) + "."


def _ldp_plain(d, _):
    plain = d["bank_plain_correct"] / d["bank"]
    rows = [f"B/Q {float(b):g}: LDPCache {v['ldpcache']['accuracy']:.3f}, LRU {v['lru']['accuracy']:.3f}, no cache "
            f"{v['no_cache']['accuracy']:.3f}" for b, v in d["pooled"].items() if float(b) >= 6]
    if not rows:
        raise ValueError("no budget of 6 or more per query in this run")
    best = max(v[a]["accuracy"] for v in d["pooled"].values() for a in ("ldpcache", "lru", "no_cache"))
    reach = "a private arm reaches" if best >= plain else "no private arm reaches"
    return (f"With a large budget {reach} the model's plain accuracy on the public bank "
            f"({plain:.3f}): " + "; ".join(rows) + ".")


def _ldp_arith(d, _):
    f = d["figures"]
    return (f"At equal epsilon per token, LDPCache minus no cache pooled over both workloads: "
            f"{sgn(f['accuracy_diff_pooled'])} {ci(f['accuracy_diff_pooled_ci95'])}; budget saved "
            f"{f['budget_saving_uniform_arith']:.2f} (uniform) and {f['budget_saving_zipf_arith']:.2f} (zipf).")
