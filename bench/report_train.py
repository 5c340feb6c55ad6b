"""Sentences bench/report.py states from the training benches' JSON (HALO, VSPO, LQZO, SMITH); see report_findings."""

from __future__ import annotations

from report_findings import sgn


def _mean_sd(s: dict) -> str:
    return "-" if s["mean"] is None else f"{s['mean']:.1f} ± {s['std'] or 0:.1f}"


def _halo_size(d, _):
    names = {"halo": "HALO", "full": "full", "stepwise": "step-wise", "lisa": "LISA"}
    out = []
    for size, s in d["summary"].items():
        m = {k: v for k, v in s["methods"].items() if k in names}
        each = lambda key, nd, m=m: ", ".join(f"{names[k]} {v[key]['mean']:.{nd}f}" for k, v in m.items())
        swept = {k: sorted(float(lr) for lr, x in d.get("sweep", {}).get(k, {}).get(size, {}).items()
                           if x is not None) for k in m}
        edge = lambda k, lr, swept=swept: " (sweep edge)" if len(swept[k]) > 1 and lr in (swept[k][0], swept[k][-1]) else ""
        out.append(f"n={size} (target val loss {s['target_val_loss']:.3f}; learning rates "
                   + ", ".join(f"{names[k]} {v['lr']:g}{edge(k, v['lr'])}" for k, v in m.items())
                   + "): steps to target " + ", ".join(
                       f"{names[k]} {_mean_sd(v['steps_to_target'])} ({v['reached']}/{len(v['seeds'])} reached)"
                       for k, v in m.items())
                   + f"; final val loss {each('final_val_loss', 3)}; forgetting (MATH-500 NLL change) "
                   + f"{each('forgetting', 3)}.")
    return out


def _halo_control(d, load):
    c = load("halo_full_lr3e-5_n32")["summary"]["32"]
    cf, h = c["methods"]["full"], d["summary"]["32"]["methods"]
    side = "below" if cf["final_val_loss"]["mean"] < h["halo"]["final_val_loss"]["mean"] else "above"
    if cf["lr"] == h["full"]["lr"]:  # the per-size sweep picked the control's rate: same runs, same numbers
        return (f"The control run at n=32 ([`halo_full_lr3e-5_n32`](halo_full_lr3e-5_n32.md), full finetuning at "
                f"{cf['lr']:g}, made when HALO's rate came from the n=8 sweep) is now the comparison's own full arm: "
                f"full finetuning's n=32 sweep picks {h['full']['lr']:g}; final val loss {cf['final_val_loss']['mean']:.3f} "
                f"there, {h['full']['final_val_loss']['mean']:.3f} here, {side} HALO's "
                f"{h['halo']['final_val_loss']['mean']:.3f} at its own n=32 rate {h['halo']['lr']:g}.")
    return (f"Control run at n=32 ([`halo_full_lr3e-5_n32`](halo_full_lr3e-5_n32.md): full finetuning at "
            f"{cf['lr']:g}, the rate HALO took from the one-sweep protocol, same data and seeds): final val loss "
            f"{cf['final_val_loss']['mean']:.3f}, {side} HALO's {h['halo']['final_val_loss']['mean']:.3f} at its "
            f"rate {h['halo']['lr']:g}; full finetuning at its own swept rate {h['full']['lr']:g} ends at "
            f"{h['full']['final_val_loss']['mean']:.3f}. The control's target comes from its own run "
            f"({c['target_val_loss']:.3f}), so its steps to target are not comparable.")


def _vspo_arms(d, _):
    def per_step(runs):  # behaviour rate at each curve step, pooled over seeds (every run has the same steps)
        steps = sorted({p["step"] for r in runs for p in r["curve"]})
        at = lambda s: [p for r in runs for p in r["curve"] if p["step"] == s]
        return ", ".join(f"{sum(p['behavior_rate'] * p['n'] for p in at(s)) / sum(p['n'] for p in at(s)):.2f}"
                         for s in steps)
    curves = {k: rs for k, rs in d.get("runs", {}).items() if rs and all(r.get("curve") for r in rs)}
    return ("Behaviour rate after training, 95% interval: " + "; ".join(
        f"{k} {v['behavior_rate']['rate']:.3f} [{v['behavior_rate']['ci95'][0]:.3f}, {v['behavior_rate']['ci95'][1]:.3f}]"
        f" (accuracy {v['accuracy']['rate']:.3f})" for k, v in d["summary"].items()) + "."
            + (" Per training step, pooled over seeds: " + "; ".join(f"{k} {per_step(rs)}" for k, rs in curves.items())
               + "." if curves else ""))


def _vspo_align(d, _):
    al, a = d["alignment"], d["alignment"]["pick"]
    t = al.get("temperature")
    how = f"at the rollout temperature {t:g}" if t else "greedy"
    base = a.get("base_behavior_rate", d["base"]["behavior_rate"])
    text = (f"Steering-vector check ({how}, n={al['n']}): behaviour rate {base:.3f} unsteered, "
            f"{a['behavior_rate']:.3f} with `{a['vector']}` at alpha {a['alpha']:g}")
    share = d["figures"].get("steered_share_above_base")
    if a.get("range"):
        return text + (f"; aligned range alpha {a['range'][0]:g}-{a['range'][1]:g}, share of VSPO's rollouts sampled "
                       f"in it {share:.2f}." if share is not None else ".")
    return text + ("; no intensity beats the unsteered rate by the check's margin, so no rollout was sampled in an "
                   "aligned range (`steered_share_above_base` " + (f"{share:.2f}" if share is not None else "n/a")
                   + ") and VSPO spread its intensities evenly (linspace).")


def _lqzo(d, _):
    s = d["summary"]
    return (f"INT2, {d['forward_passes_per_method']} forward passes per run, {s['seeds_lqzo_int2']} seeds: share of the "
            f"quantization loss gap recovered on test, QZO {s['recovered_fraction_qzo_int2'] * 100:+.1f}%, LQZO "
            f"{s['recovered_fraction_lqzo_int2'] * 100:+.1f}%; paired by seed, LQZO's test loss minus QZO's "
            f"{sgn(s['loss_lqzo_minus_qzo_int2'], 2)} ± {s['loss_lqzo_minus_qzo_int2_std']:.2f}."
            + ("" if s.get("loss_after_qlora_nf4") is None else
               f" First-order QLoRA for as many steps (NF4 base, lr {s['lr_qlora_nf4']:g} chosen on validation): test "
               f"loss {s['loss_before_qlora_nf4']:.3f} -> {s['loss_after_qlora_nf4']:.3f}, accuracy "
               f"{s['acc_before_qlora_nf4']:.3f} -> {s['acc_after_qlora_nf4']:.3f} (INT4 LQZO: "
               f"{s['loss_before_int4']:.3f} -> {s['loss_after_lqzo_int4']:.3f}, {s['acc_before_int4']:.3f} -> "
               f"{s['acc_after_lqzo_int4']:.3f}).")
            + (f" Chosen lr at the edge of its sweep: {', '.join(s['lr_at_edge'])}." if s.get("lr_at_edge") else ""))


def _lqzo_head(d, _):
    s = d["summary"]
    ql = s.get("loss_after_qlora_nf4")
    return (f"INT2 gap recovered: QZO {s['recovered_fraction_qzo_int2'] * 100:+.1f}%, LQZO "
            f"{s['recovered_fraction_lqzo_int2'] * 100:+.1f}%"
            + ("" if ql is None else f"; test loss QLoRA (NF4) {ql:.3f}, INT4 LQZO {s['loss_after_lqzo_int4']:.3f}")
            + f"; memory {s['mem_ratio_vs_qlora']:.2f}x QLoRA")


def _est_grid(s: dict) -> tuple[list[str], list[int]]:
    """The variants and direction counts of the ``cos_true_grad_<variant>_int<bits>_q<q>`` keys, in key order."""
    keys = [k[len("cos_true_grad_"):] for k in s if k.startswith("cos_true_grad_")]
    return list(dict.fromkeys(k.rsplit("_int", 1)[0] for k in keys)), sorted({int(k.rsplit("_q", 1)[1]) for k in keys})


def _lqzo_est(d, _):
    s = d["summary"]
    names, qs = _est_grid(s)
    cell = lambda n, b, q: s[f"cos_true_grad_{n}_int{b}_q{q}"]
    per = lambda b, q: ", ".join(f"{n} {cell(n, b, q)['mean']:.4f} [{cell(n, b, q)['lo']:.4f}, {cell(n, b, q)['hi']:.4f}]"
                                 for n in names)
    def best(b, q):  # the highest mean, and which variants its interval does not clear
        top = max(names, key=lambda n: cell(n, b, q)["mean"])
        tied = [n for n in names if n != top and cell(n, b, q)["hi"] >= cell(top, b, q)["lo"]]
        return f"highest mean {top}" + (f", not separated from {', '.join(tied)}" if tied else ", separated from all")
    return (f"Estimator quality, the cosine between each zeroth-order estimate and the autograd gradient of the scales "
            f"(one validation batch, mean [95% CI] over {cell(names[0], 4, qs[0])['n']} draws): "
            + "; ".join(f"INT{b} q={q}: {per(b, q)} ({best(b, q)})" for b in (4, 2) for q in (qs[0], qs[-1]))
            + "." + "".join(f" For scale, q Gaussian directions in the {p['num_scales']:,} INT{b} scales reach about "
                            f"sqrt(q/D) = {(qs[-1] / p['num_scales']) ** 0.5:.4f} at q={qs[-1]}."
                            for b, p in ((int(b), p) for b, p in d.get("per_bits", {}).items()) if b == 2))


def _lqzo_est_head(d, _):
    s = d["summary"]
    names, qs = _est_grid(s)
    return f"cosine with the true gradient at q={qs[-1]}: " + "; ".join(f"INT{b} " + ", ".join(
        f"{n} {s[f'cos_true_grad_{n}_int{b}_q{qs[-1]}']['mean']:.4f}" for n in names) for b in (4, 2))


def _lqzo_mem(d, _):
    s = d["summary"]
    return (f"An LQZO step peaks at {s['mem_ratio_vs_inference']:.2f}x inference memory and {s['mem_ratio_vs_qlora']:.2f}x"
            f" a QLoRA step, and takes {s['step_time_ratio_vs_2fwd']:.2f}x two forward passes.")


def _smith(d, _):
    c, attacks = d["conditions"], d["attacks"].values()
    return (f"Verified training-family builds {d['build_verified_rate_before']:.2f} -> {d['build_verified_rate_after']:.2f}"
            f" over the warm start; pool after GRPO {d['runs']['smith']['pool_size']} tools; held-out macro accuracy: "
            + ", ".join(f"{k} {v:.3f}" for k, v in c.items())
            + f"; sandbox attacks contained {sum(a['contained'] for a in attacks)}/{len(d['attacks'])}."
            + _smith_student(d))


def _smith_student(d) -> str:
    """What the frozen student and the use share say, where the run recorded them."""
    st, pool = d.get("student"), d.get("student_training_pool")
    if not st or not pool:
        return ""
    n = sum(st["smith_tools"]["n_per_family"].values())
    lo, hi = st["smith_tools"]["macro_ci"]
    built = len(st.get("smith_heldout_tools") or [])
    use = "; ".join(f"{arm} {', '.join(f'{u:.2f}' for u in fr)}" for arm, fr in (d.get("use_fraction") or {}).items())
    return (f" Share of use rollouts per GRPO step: {use}."
            f" The student frozen before GRPO scores {st['smith_tools']['macro']:.3f} [{lo:.3f}, {hi:.3f}] on the"
            f" held-out families with SMITH's tools ({built} held-out tools built, {n} questions) and"
            f" {d['conditions']['student_no_tools']:.3f} without tools"
            + (", so the held-out gain over the base model is the warm start's, not the tools'"
               if st["smith_tools"]["macro"] == d["conditions"]["student_no_tools"] else "")
            + f"; on the training families GRPO verified a tool for"
            f" ({', '.join(pool['families'])}) it scores {pool['with_pool']:.3f} with those tools vs"
            f" {pool['no_tools']:.3f} without (call parse rate {pool['call_parse_rate']:.3f}).")


def _lqzo_long(d, _):
    s = d["summary"]

    def cell(bits):
        return (f"INT{bits} untrained {s[f'loss_before_int{bits}']:.3f}, QZO {s[f'loss_after_qzo_int{bits}']:.3f} "
                f"(lr {s[f'lr_qzo_int{bits}']:g}), LQZO {s[f'loss_after_lqzo_int{bits}']:.3f} "
                f"(lr {s[f'lr_lqzo_int{bits}']:g})")

    def diff(bits):
        p, a = s[f"paired_diff_int{bits}"], s[f"paired_acc_diff_int{bits}"]
        return (f"INT{bits} {sgn(p['mean'], 3)} [{sgn(p['lo'], 3)}, {sgn(p['hi'], 3)}] (accuracy {sgn(a['mean'], 3)} "
                f"[{sgn(a['lo'], 3)}, {sgn(a['hi'], 3)}]; LQZO lower in {p['a_better']} of {p['n']} seeds)")

    edge = (" Chosen at the edge of its sweep (the optimum may lie outside): " + ", ".join(s["lr_at_edge"]) + "."
            if s.get("lr_at_edge") else "")
    return (f"{s['steps_per_run']} ZO steps per run at batch {s['batch']} on sentiment rows, the lr of each cell "
            f"chosen on validation, {s['seeds_lqzo_int2']} seeds at INT2 and {s['seeds_lqzo_int4']} at INT4: test "
            f"loss (full precision "
            f"{s['loss_full_precision']:.3f}) {cell(2)}; {cell(4)}. LQZO minus QZO paired by seed, test loss with 95% "
            f"interval: {diff(2)}; {diff(4)}. The paper's INT2 claim (LQZO below QZO): {s['int2_claim']}. A step "
            f"took {s['step_s']:.2f} s on one thread, {s['train_core_hours']:.1f} core-hours of training in all."
            + edge)

