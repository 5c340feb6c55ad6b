"""Sentences bench/report.py states from bench/hgms.py's JSON (HG-MS against uniform, DoReMi, DoGE and ODM)."""

from __future__ import annotations

from report_findings import ci, said, sgn


def _hgms(d, _):
    s, methods = d["summary"], list(d["methods"])
    m_ci = lambda k: f"{s[k]:.4f} [{s[k + '_ci'][0]:.4f}, {s[k + '_ci'][1]:.4f}]"
    acc = lambda m: f", accuracy {m_ci(f'heldout_accuracy_{m}')}" if f"heldout_accuracy_{m}" in s else ""
    per = "; ".join(f"{m} {m_ci(f'heldout_loss_{m}')}{acc(m)}, noisy-source weight {s[f'weight_noisy_{m}']:.3f}" for m in methods)
    diffs = [(m, s[f"heldout_loss_diff_{m}_vs_uniform"], s[f"heldout_loss_diff_{m}_vs_uniform_ci"])
             for m in methods if m != "uniform"]
    apart = [f"{m} ({'higher' if lo > 0 else 'lower'})" for m, _, (lo, hi) in diffs if lo > 0 or hi < 0]
    return (f"Held-out GSM8K loss (mean [95% CI] over {s['seeds']} seeds): {per}. Paired by seed, minus uniform: "
            + ", ".join(f"{m} {sgn(x, 4)} {ci(c, 4)}" for m, x, c in diffs)
            + (f"; only {', '.join(apart)} separated from uniform." if apart else "; no method separated from uniform.")
            + f" The trust rule refused {s['refused_share_hgms']:.0%} of HG-MS's weight updates; HG-MS takes "
              f"{s['step_time_ratio_hgms']:.2f}x uniform's step time" + _moved(d["methods"]["hgms"]) + ".")


def _moved(runs) -> str:
    """How often the selection step (it trains on target examples) had a certified flat direction to move along."""
    h = [x["signals"] for r in runs for x in r["history"] if "hgms_flat_dims" in x.get("signals", {})]
    return (f"; its selection step certified a flat direction (so moved, on target examples) at "
            f"{sum(x['hgms_flat_dims'] > 0 for x in h)} of {len(h)} updates") if h else ""


def _hgms_rank(d, _):
    """Where HG-MS stands: its rank by mean held-out loss and, seed by seed, whom it beats."""
    runs = d["methods"]
    loss = {m: {r["seed"]: r["heldout_loss"] for r in rs} for m, rs in runs.items()}
    order = sorted(loss, key=lambda m: sum(loss[m].values()) / len(loss[m]))
    below = ", ".join(f"{m} in {sum(loss['hgms'][k] < v for k, v in loss[m].items())} of {len(loss[m])} seeds"
                      for m in order if m != "hgms")
    first = [next((h["step"] for prev, h in zip(r["history"], r["history"][1:]) if h["weights"] != prev["weights"]),
                  None) for r in runs["hgms"]]
    refused = [h["signals"] for r in runs["hgms"] for prev, h in zip(r["history"], r["history"][1:])
               if h["weights"] == prev["weights"] and "signals" in h]  # a refused update leaves the weights as they were
    saddle = sum(x.get("hgms_trust_curvature", 1) == 0 for x in refused)
    return (f"By mean held-out loss: {' < '.join(order)}. HG-MS is below {below}. Its first trusted weight update "
            f"came at step {', '.join('never' if x is None else str(x) for x in first)} (per seed, of {runs['hgms'][0]['steps']}); of its "
            f"{len(refused)} refused updates, {saddle} read a saddle (smoothed negative curvature at least half the "
            "largest Ritz value: LoRA starts at B = 0, a saddle of the inner loss).")


def _hgms_head(d, _):
    s = d["summary"]
    diffs = ", ".join(f"{m} {sgn(s[f'heldout_loss_diff_{m}_vs_uniform'], 3)}" for m in d["methods"] if m != "uniform")
    return (f"held-out loss minus uniform: {diffs}; noisy-source weight HG-MS {s['weight_noisy_hgms']:.2f}, DoReMi "
            f"{s['weight_noisy_doremi']:.2f} (uniform 0.5; HG-MS updates refused {s['refused_share_hgms']:.0%})")


HGMS = {"about": "Held-out GSM8K loss and accuracy and the noisy source's weight per weighting method, with seed "
                 "intervals and differences to uniform paired by seed.", "headline": _hgms_head, "findings": said(_hgms, _hgms_rank)}
