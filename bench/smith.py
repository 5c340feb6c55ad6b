"""SMITH bench: sandbox overhead and escapes, and held-out-family macro accuracy of the bundled model against the
paper's baselines, all in one run.

    python bench/smith.py --quick      # small: 4 questions per held-out family, a few GRPO steps
    python bench/smith.py              # larger (still a CPU run of a few tens of minutes)

Conditions (held-out families only; none of them is seen in training):
  no_tools            the base model answers the questions directly
  reference_tools     the base model calls our reference tool for each family (ground-truth tools)
  warm_reference_tools  the warm-started policy (before GRPO) calls the reference tools: did the warm start teach
                      the call format? (full run only; ``use_call_parse_rate*``: share of replies holding a
                      parseable call; the quick run measures it on the base model and after warm start + GRPO)
  untrained_writer    the base model writes a tool per family from K examples (inference-time tool making), then
                      answers with it
  smith               warm start (SFT on reference traces of the TRAINING families, documented) + SMITH GRPO with
                      the three axes normalized separately; the trained policy writes the tools and answers
  combined_reward     the same, with schema+code+outcome summed into one scalar before the advantage (ablation)
  student_*           a frozen student that can call tools: the warm-started policy, frozen BEFORE GRPO, answers with
                      the held-out tools written by the GRPO-trained policy / by the untrained writer, with the
                      reference tools, and without tools; ``student.*.call_parse_rate`` says it parses (so the
                      comparison measures the tools, not the call syntax)
GRPO: every step holds use_share (0.5) use prompts; the pool starts with the training families' verified reference
tools (seed_pool reference: the warm start's targets), so use rollouts train from step one; ``use_fraction`` per
step is the share of use rollouts in that step.
Held-out macro accuracies come with the questions per family and the exact binomial interval (``heldout``).
Warm start (documented deviation, training families only): SFT on reference-tool traces, one third use traces
(the exact <tool_call> JSON + answer), two thirds build traces (spec + code); --quick trains only the top 10 layers
for 20 steps of 4 traces, because a full backward pass does not fit the shared CPU. ``build_verified_rate``: the
share of greedy build attempts on TRAINING-family prompts (one per family) that yield a verified tool, before and
after the warm start (an earlier warm start of 6 steps with one third build traces left it at 0: the writer put
argument values where the JSON Schema goes, so no GRPO group had any reward).
Families without a verified tool fall back to answering without one (so a writer that makes no tool scores like
no_tools). Sandbox: p50/p95 ms per call against an unconfined subprocess running the same runner (the anchor), and
the attack set of llmkit.tools.attacks (escapes must be 0).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def plot(res: dict, png: Path, runs: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = ["no_tools", "reference_tools", "warm_reference_tools", "untrained_writer", "smith", "combined_reward",
             "student_no_tools", "student_untrained_tools", "student_smith_tools", "student_reference_tools"]
    names = [k for k in names if k in res["conditions"]]
    vals = [res["conditions"][k] for k in names]
    colors = {"no_tools": "gray", "reference_tools": "green", "warm_reference_tools": "olive", "smith": "C0",
              "combined_reward": "C1", "student_smith_tools": "C0"}
    axes[0].bar(range(len(names)), vals, color=[colors.get(k, "orange") for k in names])
    axes[0].set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    axes[0].set_ylabel("held-out macro accuracy")
    axes[0].set_title(f"held-out families (n={res['n_per_family']} each)")
    for name, run in runs.items():
        for axis, style in (("schema_reward", "-"), ("code_reward", "--"), ("outcome_reward", ":"),
                            ("combined_reward", "-.")):
            xs, ys = run["curves"].get(axis, ([], []))
            if xs:
                axes[1].plot(xs, ys, style, marker=".", label=f"{name} {axis.split('_')[0]}")
        xs, ys = run["curves"].get("pool_size", ([], []))
        if xs:
            axes[2].plot(xs, ys, marker="o", label=name)
    axes[1].set_title("reward axes per step")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    axes[2].set_title("pool size (verified tools)")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def curves(metrics: Path) -> dict:
    out = {}
    if not metrics.is_file():
        return out
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        for key, name in (("rewards/schema_reward/mean", "schema_reward"), ("rewards/code_reward/mean", "code_reward"),
                          ("rewards/outcome_reward/mean", "outcome_reward"), ("smith/pool_size", "pool_size"),
                          ("rewards/combined_reward/mean", "combined_reward"),
                          ("frac_reward_zero_std", "frac_reward_zero_std"), ("smith/use_fraction", "use_fraction")):
            if isinstance(rec.get(key), (int, float)):
                out.setdefault(name, ([], []))
                out[name][0].append(rec["step"])
                out[name][1].append(rec[key])
    return out


STAT_KEYS = ("macro", "n_per_family", "correct_per_family", "macro_ci", "call_parse_rate")


def stats(r: dict) -> dict:
    """What the JSON keeps of one evaluation: the macro, its counts and binomial interval, the call parse rate."""
    return {k: r.get(k) for k in STAT_KEYS}


def _part(work: Path, name: str, fn) -> dict:
    """Run one part of the bench and keep its results in ``<work>/part_<name>.json`` (parts can run as separate
    processes side by side: ``--only base``, ``--only smith``, ``--only combined_reward``, then ``--only merge``)."""
    d = fn()
    (work / f"part_{name}.json").write_text(json.dumps(d, indent=2) + "\n")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", default=str(REPO / "outputs" / "bench-smith"), help="scratch folder for the runs")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (the shared 2-core machine generated faster with 1)")
    ap.add_argument("--only", choices=("base", "warm", "smith", "combined_reward", "merge"), default=None,
                    help="run one part (results kept in the work folder); merge writes the JSON from the parts. "
                         "smith/combined_reward start from <work>/warm/model (made by the warm part)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    q = args.quick
    n, grpo_steps, warm_steps = (4, 2, 20) if q else (8, 12, 60)
    # a third of the warm-start traces are use traces (the call format is learnt from few), two thirds build traces
    warm_use_share = 0.34
    # a call is <= ~55 tokens (the answer line after it is not needed); a reference build trace up to ~230 tokens
    max_new, build_max_new = (64, 256) if q else (96, 320)
    work = Path(args.work) / ("quick" if q else "full")
    if args.only is None:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    from trl import ModelConfig

    from llmkit.models import DEFAULT_MODEL, load, load_for_training
    from llmkit.tools import ToolPool, tasks
    from llmkit.tools.attacks import run_attacks
    from llmkit.tools.evaluate import (
        build_tools,
        build_verified_rate,
        evaluate,
        local_generator,
        sandbox_overhead,
    )
    from llmkit.train.smith.config import SmithConfig
    from llmkit.train.smith.recipe import main as smith_main
    from llmkit.train.smith.recipe import ready_for_generation, warm_start

    fams = tasks.HELDOUT_FAMILIES
    todo = ("base", "warm", "smith", "combined_reward", "merge") if args.only is None else (args.only,)

    def base() -> dict:
        ov = sandbox_overhead(20 if q else 60)
        print(f"sandbox per call: p50 {ov['p50_ms']:.1f} ms, p95 {ov['p95_ms']:.1f} ms; unconfined subprocess "
              f"anchor p50 {ov['anchor_p50_ms']:.1f} ms; ratio {ov['ratio']:.2f}x")
        outcomes = run_attacks()
        attacks = {o.name: {"contained": o.contained, "detail": o.detail, "wall_s": round(o.wall_s, 3)}
                   for o in outcomes}
        escapes = sum(not o.contained for o in outcomes)
        print(f"sandbox attacks: {len(outcomes) - escapes}/{len(outcomes)} contained, escapes {escapes}")
        model, tok = load(DEFAULT_MODEL)
        gen = local_generator(model, tok, max_new_tokens=max_new, batch_size=16)
        build_gen = local_generator(model, tok, max_new_tokens=build_max_new, batch_size=16)
        cond, per_fam, samples, held = {}, {}, {}, {}
        r = evaluate(gen, fams, mode="none", n=n)
        cond["no_tools"], per_fam["no_tools"], held["no_tools"] = r["macro"], r["per_family"], stats(r)
        r = evaluate(gen, fams, mode="reference", n=n)
        cond["reference_tools"], per_fam["reference_tools"], held["reference_tools"] = r["macro"], r["per_family"], stats(r)
        parse = r["call_parse_rate"]
        samples["base_reference_tools"] = r["sample_replies"]
        upool = ToolPool(work / "untrained_pool")
        built = build_tools(build_gen, fams, upool, examples=3, checks=4, source=DEFAULT_MODEL)
        r = evaluate(gen, fams, pool=upool, n=n)
        cond["untrained_writer"], per_fam["untrained_writer"], held["untrained_writer"] = (r["macro"], r["per_family"],
                                                                                       stats(r))
        for k in ("no_tools", "reference_tools", "untrained_writer"):
            print(f"held-out macro acc {k}: {cond[k]:.3f}")
        print(f"use call parse rate, base model with the reference tools: {parse:.3f}")
        return {"sandbox": ov, "attacks": attacks, "escapes": escapes, "conditions": cond, "per_family": per_fam,
                "parse_base": parse, "sample_replies": samples, "heldout_stats": held,
                "untrained_builds": {k: {a: v[a] for a in ("schema", "code", "outcome", "added")}
                                     for k, v in built.items()}}

    def warm() -> dict:
        # warm start once (training families only); SMITH and the combined-reward ablation both start from it.
        # build_verified_rate: share of build attempts on TRAINING-family prompts (greedy, one per family) that
        # yield a verified tool, before and after the warm start
        t0 = time.time()
        wcfg = SmithConfig(output_dir=str(work / "warm"), use_cpu=True, bf16=False, report_to="none",
                           warm_start_steps=warm_steps, warm_start_lr=3e-4 if q else 1e-4,
                           warm_start_top_layers=10 if q else 0, warm_start_use_share=warm_use_share,
                           per_device_train_batch_size=4, num_generations=4, build_examples=3, seed=0)
        wmodel, wtok = load_for_training(ModelConfig(model_name_or_path=DEFAULT_MODEL), output_dir=work)
        out = {}
        for when in ("before", "after"):
            if when == "after":
                t1 = time.time()
                wmodel = warm_start(wcfg, wmodel, wtok, tasks.TRAIN_FAMILIES, work / "warm")
                out["warm_start_seconds"] = round(time.time() - t1, 1)
            ready_for_generation(wmodel)
            bv = build_verified_rate(local_generator(wmodel, wtok, max_new_tokens=build_max_new, batch_size=9),
                                     tasks.TRAIN_FAMILIES, attempts=1, examples=3, checks=4)
            out[f"build_verified_rate_{when}"] = bv["rate"]
            out[f"build_{when}"] = bv
            print(f"build_verified_rate {when} warm start (training families, {bv['attempts']} attempts): "
                  f"{bv['rate']:.3f}; failures " + ", ".join(f"{k} {v}" for k, v in bv["failures"].items()))
        if not q:  # the quick run measures the parse rate after warm start + GRPO only (the smith run), for time
            r = evaluate(local_generator(wmodel, wtok, max_new_tokens=max_new), fams, mode="reference", n=n)
            out.update(warm_reference_tools=r["macro"], per_family=r["per_family"], parse=r["call_parse_rate"],
                       sample_replies=r["sample_replies"], heldout_stats=stats(r))
            print(f"held-out macro acc warm_reference_tools: {r['macro']:.3f}; use call parse rate after warm "
                  f"start {r['call_parse_rate']:.3f}")
        out["warm_part_seconds"] = round(time.time() - t0, 1)
        wmodel.save_pretrained(work / "warm" / "model")
        wtok.save_pretrained(work / "warm" / "model")
        return out

    def run(name: str, agg: str) -> dict:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        cfg = SmithConfig(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", reward_aggregation=agg,
                          max_steps=grpo_steps, per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=build_max_new, temperature=0.8, learning_rate=1e-5,
                          beta=0.0, logging_steps=1, save_strategy="no", num_prompts=8 * grpo_steps,
                          gradient_checkpointing=False,  # 135M on CPU: memory is no issue, recomputation is
                          use_share=0.5, seed_pool="reference", build_examples=3, build_checks=4, eval_n=n, eval_max_new_tokens=max_new,
                          eval_build_max_new_tokens=build_max_new, eval_no_tools=not q,
                          eval_reference=not q or name == "smith", dataloader_num_workers=0, seed=0)
        t0 = time.time()
        smith_main(cfg, ModelConfig(model_name_or_path=str(work / "warm" / "model")))
        ev = json.loads((out / "eval.json").read_text())
        ref = ev["after"]["reference_tools"]
        d = {"macro": ev["after"]["with_tools"]["macro"], "per_family": ev["after"]["with_tools"]["per_family"],
             "heldout_stats": stats(ev["after"]["with_tools"]), "use_fraction": ev.get("use_fraction"),
             "seeded_pool": ev.get("seeded_pool"),
             "reference_macro": ref["macro"] if ref else None, "parse": ev["after"]["use_call_parse_rate"],
             "sample_replies": ev["after"]["with_tools"]["sample_replies"],
             "reference_sample_replies": ref["sample_replies"] if ref else None,
             "run": {"seconds": round(time.time() - t0, 1), "pool_size": ev["pool_size"],
                     "pool_growth": ev["pool_growth"], "heldout_builds": ev["after"]["built"],
                     "policy_no_tools_macro": (ev["after"]["no_tools"] or {}).get("macro"),
                     "curves": curves(out / "metrics.jsonl")}}
        per_step = {k: "[" + ", ".join(f"{y:.2f}" for y in v[1]) + "]" for k, v in d["run"]["curves"].items() if v[1]}
        nt = d["run"]["policy_no_tools_macro"]
        print(f"held-out macro acc {name}: {d['macro']:.3f}"
              + (f" (policy without tools {nt:.3f})" if nt is not None else "")
              + (f" (policy with the reference tools {d['reference_macro']:.3f}, use call parse rate "
                 f"{d['parse']:.3f})" if ref else "")
              + f"; training pool {ev['pool_size']} tools; per step "
              + ", ".join(f"{k} {v}" for k, v in per_step.items()))
        return d

    for part in todo:
        if part == "base":
            _part(work, "base", base)
        elif part == "warm":
            _part(work, "warm", warm)
        elif part in ("smith", "combined_reward"):
            _part(work, part, lambda p=part: run(p, "normalize_then_sum" if p == "smith" else "combined"))
    if "merge" not in todo:
        return 0

    parts = {k: json.loads((work / f"part_{k}.json").read_text())
             for k in ("base", "warm", "smith", "combined_reward") if (work / f"part_{k}.json").is_file()}
    missing = {"base", "smith"} - set(parts)
    if missing:
        raise SystemExit(f"missing parts {sorted(missing)} in {work}: run them with --only first")
    # when each part was written (parts may come from separate invocations: --only base, --only smith ...)
    written = {k: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((work / f"part_{k}.json").stat().st_mtime))
               for k in parts}
    if "combined_reward" not in parts:
        print("combined_reward: not run (no part_combined_reward.json in the work folder); its keys are null")
    b, w = parts["base"], parts.get("warm", {})
    if not (work / "warm" / "model").is_dir():
        raise SystemExit(f"no warm-started model in {work / 'warm' / 'model'} (the frozen student): run --only warm")
    cond, per_fam, held = dict(b["conditions"]), dict(b["per_family"]), dict(b["heldout_stats"])
    parse = {"base": b["parse_base"]}
    if "warm_reference_tools" in w:
        cond["warm_reference_tools"], per_fam["warm_reference_tools"] = w["warm_reference_tools"], w["per_family"]
        parse["warm_start"], held["warm_reference_tools"] = w["parse"], w["heldout_stats"]
    samples = dict(b["sample_replies"])
    runs, use_fraction = {}, {}
    for name in [k for k in ("smith", "combined_reward") if k in parts]:
        d = parts[name]
        cond[name], per_fam[name], runs[name] = d["macro"], d["per_family"], d["run"]
        held[name], use_fraction[name] = d["heldout_stats"], d["use_fraction"]
        samples[name] = d["sample_replies"]
        if d["reference_macro"] is not None:
            cond[f"{name}_reference_tools"], parse[name] = d["reference_macro"], d["parse"]
            samples[f"{name}_reference_tools"] = d["reference_sample_replies"]
    # ---- frozen student: the warm-started policy, frozen before GRPO. It emits the call format (the base model
    # does not: its parse rate is use_call_parse_rate.base), so its accuracy with each writer's tools measures the
    # tools, not the call syntax
    student: dict = {}

    def student_gen():
        if "gen" not in student:
            model, tok = load(str(work / "warm" / "model"))
            student["gen"] = local_generator(ready_for_generation(model), tok, max_new_tokens=max_new, batch_size=16)
        return student["gen"]

    spool, upool = ToolPool(work / "smith" / "eval_pool_after"), ToolPool(work / "untrained_pool")
    student_res = {"model": "the warm-started policy, frozen before GRPO", "smith_heldout_tools": spool.families(),
                   "untrained_heldout_tools": upool.families()}
    for k, r in (("smith_tools", evaluate(student_gen(), fams, pool=spool, n=n)),
                 ("untrained_tools", evaluate(student_gen(), fams, pool=upool, n=n)),
                 ("reference_tools", evaluate(student_gen(), fams, mode="reference", n=n)),
                 ("no_tools", evaluate(student_gen(), fams, mode="none", n=n))):
        cond[f"student_{k}"], per_fam[f"student_{k}"], held[f"student_{k}"] = r["macro"], r["per_family"], stats(r)
        student_res[k] = stats(r)
    print(f"frozen student (warm start, before GRPO): with SMITH-written tools {cond['student_smith_tools']:.3f} "
          f"({len(spool.families())} held-out tools), with untrained-writer tools "
          f"{cond['student_untrained_tools']:.3f} ({len(upool.families())}), with the reference tools "
          f"{cond['student_reference_tools']:.3f} (call parse rate "
          f"{student_res['reference_tools']['call_parse_rate']:.3f}), without tools {cond['student_no_tools']:.3f}")
    # the same frozen student with the tools GRPO's own builds verified (training families, evaluation questions
    # never used in training; the seeded reference tools left out), against answering those questions without tools
    policy_tools = [e for e in ToolPool(work / "smith" / "pool").entries() if e.source == "policy"]
    student_train = None
    if policy_tools:
        shutil.rmtree(work / "smith_policy_pool", ignore_errors=True)
        tpool = ToolPool(work / "smith_policy_pool")
        for e in policy_tools:
            tpool.add(e.spec, e.family, e.score, step=e.step, source=e.source)
        tf = tpool.families()
        r = evaluate(student_gen(), tf, pool=tpool, n=n)
        r0 = evaluate(student_gen(), tf, mode="none", n=n)
        student_train = {"families": tf, "with_pool": r["macro"], "no_tools": r0["macro"],
                         "per_family_with_pool": r["per_family"], "per_family_no_tools": r0["per_family"],
                         "call_parse_rate": r["call_parse_rate"], "with_pool_stats": stats(r),
                         "no_tools_stats": stats(r0)}
        print(f"frozen student on the {len(tf)} training families GRPO verified a tool for: with those tools "
              f"{r['macro']:.3f} vs without tools {r0['macro']:.3f} (call parse rate {r['call_parse_rate']:.3f})")
    for k in [k for k in ("smith", "combined_reward", "untrained_writer", "reference_tools") if k in cond]:
        print(f"difference {k} - no_tools: {cond[k] - cond['no_tools']:+.3f}")

    for k in ("before", "after"):
        if f"build_verified_rate_{k}" in w:
            print(f"build_verified_rate {k} warm start: {w[f'build_verified_rate_{k}']:.3f}")
    ov, escapes = b["sandbox"], b["escapes"]
    res: dict = {"quick": q, "model": DEFAULT_MODEL, "n_per_family": n, "grpo_steps": grpo_steps,
                 "warm_start_steps": warm_steps, "max_new_tokens": max_new, "build_max_new_tokens": build_max_new,
                 "heldout": list(fams), "train_families": list(tasks.TRAIN_FAMILIES),
                 "warm_start_seconds": w.get("warm_start_seconds"),
                 "build_verified_rate_before": w.get("build_verified_rate_before"),
                 "build_verified_rate_after": w.get("build_verified_rate_after"),
                 "warm_builds": {k: w.get(f"build_{k}") for k in ("before", "after")}, "sandbox": ov, "attacks": b["attacks"],
                 "untrained_builds": b["untrained_builds"], "conditions": cond, "per_family": per_fam, "runs": runs,
                 "use_call_parse_rate": parse, "sample_replies": samples, "student_training_pool": student_train,
                 "student": student_res, "heldout_stats": held, "use_fraction": use_fraction,
                 "seeded_pool": parts["smith"].get("seeded_pool"),
                 "parts_written_utc": written, "merge_seconds": round(time.time() - t_start, 1)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "smith_quick" if q else "smith"
    (RESULTS / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / f"{stem}.png", runs)
    print(f"wrote {RESULTS / (stem + '.json')} and {stem}.png")
    summary = {"heldout_macro_acc": cond["smith"], "heldout_macro_acc_untrained_writer": cond["untrained_writer"],
               "heldout_macro_acc_no_tools": cond["no_tools"],
               "heldout_macro_acc_reference_tools": cond["reference_tools"],
               "heldout_macro_acc_combined_reward": cond.get("combined_reward"),
               "student_macro_acc_smith_tools": cond["student_smith_tools"],
               "student_macro_acc_untrained_tools": cond["student_untrained_tools"],
               "student_macro_acc_reference_tools": cond["student_reference_tools"],
               "student_macro_acc_no_tools": cond["student_no_tools"],
               "student_call_parse_rate": student_res["reference_tools"]["call_parse_rate"],
               "student_call_parse_rate_smith_tools": student_res["smith_tools"]["call_parse_rate"],
               "heldout_macro_acc_ci": held["smith"]["macro_ci"],
               "heldout_questions_per_family": held["smith"]["n_per_family"],
               "use_fraction": use_fraction.get("smith"),
               "use_fraction_combined_reward": use_fraction.get("combined_reward"),
               "heldout_macro_acc_warm_start_reference_tools": cond.get("warm_reference_tools"),
               "heldout_macro_acc_smith_reference_tools": cond.get("smith_reference_tools"),
               "use_call_parse_rate_base": parse["base"], "use_call_parse_rate_warm_start": parse.get("warm_start"),
               "use_call_parse_rate": parse.get("smith"),
               "build_verified_rate_before": w.get("build_verified_rate_before"),
               "build_verified_rate_after": w.get("build_verified_rate_after"),
               "pool_size": runs["smith"]["pool_size"],
               "pool_size_combined_reward": runs.get("combined_reward", {}).get("pool_size"),
               "student_macro_acc_smith_training_pool": student_train["with_pool"] if student_train else None,
               "student_macro_acc_training_families_no_tools": student_train["no_tools"] if student_train else None,
               "sandbox_p50_ms": round(ov["p50_ms"], 2), "sandbox_p95_ms": round(ov["p95_ms"], 2),
               "sandbox_overhead_ratio": round(ov["ratio"], 3), "sandbox_escapes": escapes}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
