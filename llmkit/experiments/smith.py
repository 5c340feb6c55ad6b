"""SMITH's bench (``bench/smith.py``): sandbox cost and containment, and held-out-family macro accuracy of the
bundled model under each condition, built from parts that can run as separate processes.

Parts (each saved in the work folder through a ``harness.ResultStore`` keyed by the ``Preset``):

* ``base``: the sandbox's per-call latency against an unconfined subprocess running the same runner (the
  anchor) and the attack set of ``llmkit.tools.attacks`` (escapes must be 0); the base model without tools,
  with the reference tools, and with the tools it writes itself from K examples (``untrained_writer``).
* ``warm``: the warm start (SFT on reference traces of the TRAINING families only), with the share of greedy
  build attempts on training-family prompts that yield a verified tool before and after it; on the full preset
  also the warm-started policy with the reference tools (did the warm start teach the call format?).
* ``smith`` / ``combined_reward``: SMITH GRPO from the warm-started model, the three axes normalized separately
  or summed into one scalar before the advantage (the paper's ablation); the trained policy writes the held-out
  tools and answers with them.
* ``merge`` (:func:`merge`): a frozen student, the warm-started policy before GRPO, answers with the held-out
  tools written by the GRPO-trained policy, by the untrained writer, with the reference tools and without tools
  (its call parse rate says it emits the call format, so the comparison measures the tools, not the syntax), and
  with the tools GRPO's own builds verified on training families; then the JSON and its one-line summary.

Every held-out macro comes with its per-family counts and exact binomial interval (``heldout_stats``, from
``llmkit.tools.evaluate``). A family without a verified tool falls back to answering without one, so a writer
that makes no tool scores like no tools. Measured figures: bench/results/smith.md.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llmkit.experiments.harness import ResultStore

STAT_KEYS = ("macro", "n_per_family", "correct_per_family", "macro_ci", "call_parse_rate")
PARTS = ("base", "warm", "smith", "combined_reward")
PLOTTED = ("no_tools", "reference_tools", "warm_reference_tools", "untrained_writer", "smith", "combined_reward",
           "student_no_tools", "student_untrained_tools", "student_smith_tools", "student_reference_tools")
CURVE_KEYS = (("rewards/schema_reward/mean", "schema_reward"), ("rewards/code_reward/mean", "code_reward"),
              ("rewards/outcome_reward/mean", "outcome_reward"), ("smith/pool_size", "pool_size"),
              ("rewards/combined_reward/mean", "combined_reward"), ("frac_reward_zero_std", "frac_reward_zero_std"),
              ("smith/use_fraction", "use_fraction"))


@dataclass(frozen=True)
class Preset:
    """Sizes of one bench run. A call is <= ~55 tokens (the answer line after it is not needed), a reference
    build trace up to ~230; a third of the warm-start traces are use traces (the call format is learnt from few)."""

    quick: bool
    n: int  # questions per held-out family
    grpo_steps: int
    warm_steps: int
    max_new: int
    build_max_new: int
    warm_use_share: float = 0.34

    @classmethod
    def of(cls, quick: bool) -> Preset:
        if quick:
            return cls(quick=True, n=4, grpo_steps=2, warm_steps=20, max_new=64, build_max_new=256)
        return cls(quick=False, n=8, grpo_steps=12, warm_steps=60, max_new=96, build_max_new=320)


def parts_store(work: Path, preset: Preset) -> ResultStore:
    """``part_<name>.json`` files in ``work``; a part made with another preset does not count."""
    return ResultStore(work, asdict(preset))


def heldout_stats(r: dict) -> dict:
    """What the JSON keeps of one evaluation: the macro, its counts and binomial interval, the call parse rate."""
    return {k: r.get(k) for k in STAT_KEYS}


def reward_curves(metrics: Path) -> dict:
    """``{name: ([step...], [value...])}`` of the reward axes, pool size and use share from a ``metrics.jsonl``."""
    out: dict = {}
    if not Path(metrics).is_file():
        return out
    for line in Path(metrics).read_text().splitlines():
        rec = json.loads(line)
        for key, name in CURVE_KEYS:
            if isinstance(rec.get(key), (int, float)):
                out.setdefault(name, ([], []))
                out[name][0].append(rec["step"])
                out[name][1].append(rec[key])
    return out


def sandbox_overhead(n: int = 30, *, unsafe_anchor: bool = True) -> dict:
    """Wall time per trivial call (ms, median and p95) through the sandbox, and through the same runner in a plain
    subprocess (the anchor: what process start-up alone costs); ``ratio`` = sandbox p50 / anchor p50."""
    from llmkit.tools.sandbox import run_function

    code = "def f(x):\n    return x + 1\n"

    def times(unsafe: bool) -> list[float]:
        out = []
        for i in range(n):
            r = run_function(code, "f", {"x": i}, unsafe=unsafe)
            if not (r.ok and r.value == i + 1):
                raise RuntimeError(f"sandbox call failed: {r.error}")
            out.append(r.wall_s * 1000)
        return out

    def pct(xs, q):  # nearest rank: a value that was measured
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    box = times(False)
    res = {"n": n, "p50_ms": statistics.median(box), "p95_ms": pct(box, 0.95)}
    if unsafe_anchor:
        plain = times(True)
        res.update(anchor_p50_ms=statistics.median(plain), anchor_p95_ms=pct(plain, 0.95),
                   ratio=statistics.median(box) / statistics.median(plain))
    return res


def sandbox_part(calls: int) -> dict:
    """``{sandbox, attacks, escapes}``: latency against the anchor and the attack set's outcome."""
    from llmkit.tools.attacks import run_attacks

    ov = sandbox_overhead(calls)
    print(f"sandbox per call: p50 {ov['p50_ms']:.1f} ms, p95 {ov['p95_ms']:.1f} ms; unconfined subprocess "
          f"anchor p50 {ov['anchor_p50_ms']:.1f} ms; ratio {ov['ratio']:.2f}x")
    outcomes = run_attacks()
    attacks = {o.name: {"contained": o.contained, "detail": o.detail, "wall_s": round(o.wall_s, 3)} for o in outcomes}
    escapes = sum(not o.contained for o in outcomes)
    print(f"sandbox attacks: {len(outcomes) - escapes}/{len(outcomes)} contained, escapes {escapes}")
    return {"sandbox": ov, "attacks": attacks, "escapes": escapes}


def base_part(work: Path, p: Preset, model_name: str | None = None, sandbox_calls: int | None = None) -> dict:
    """The sandbox, then the base model (default: the bundled one) without tools, with the reference tools and
    with the tools it writes itself."""
    from llmkit.models import DEFAULT_MODEL, load
    from llmkit.tools import ToolPool, tasks
    from llmkit.tools.evaluate import build_tools, evaluate, local_generator

    out = sandbox_part(sandbox_calls or (20 if p.quick else 60))
    fams = tasks.HELDOUT_FAMILIES
    model_name = model_name or DEFAULT_MODEL
    model, tok = load(model_name)
    gen = local_generator(model, tok, max_new_tokens=p.max_new, batch_size=16)
    build_gen = local_generator(model, tok, max_new_tokens=p.build_max_new, batch_size=16)
    cond, per_fam, held, samples = {}, {}, {}, {}

    def keep(name, r):
        cond[name], per_fam[name], held[name] = r["macro"], r["per_family"], heldout_stats(r)
        return r

    keep("no_tools", evaluate(gen, fams, mode="none", n=p.n))
    r = keep("reference_tools", evaluate(gen, fams, mode="reference", n=p.n))
    parse, samples["base_reference_tools"] = r["call_parse_rate"], r["sample_replies"]
    upool = ToolPool(work / "untrained_pool")
    built = build_tools(build_gen, fams, upool, examples=3, checks=4, source=model_name)
    keep("untrained_writer", evaluate(gen, fams, pool=upool, n=p.n))
    for k in ("no_tools", "reference_tools", "untrained_writer"):
        print(f"held-out macro acc {k}: {cond[k]:.3f}")
    print(f"use call parse rate, base model with the reference tools: {parse:.3f}")
    return {**out, "conditions": cond, "per_family": per_fam, "parse_base": parse, "sample_replies": samples,
            "heldout_stats": held,
            "untrained_builds": {k: {a: v[a] for a in ("schema", "code", "outcome", "added")} for k, v in built.items()}}


def warm_part(work: Path, p: Preset) -> dict:
    """Warm start once (training families only; SMITH and the ablation both start from ``<work>/warm/model``).
    ``build_verified_rate``: share of greedy build attempts on TRAINING-family prompts, one per family, that yield
    a verified tool, before and after the warm start. The quick preset trains only the top 10 layers (a full
    backward pass does not fit the shared CPU) and measures the parse rate after GRPO only (the smith part)."""
    from trl import ModelConfig

    from llmkit.models import DEFAULT_MODEL, load_for_training
    from llmkit.tools import tasks
    from llmkit.tools.evaluate import build_verified_rate, evaluate, local_generator
    from llmkit.train.smith.config import SmithConfig
    from llmkit.train.smith.recipe import ready_for_generation, warm_start

    t0 = time.time()
    wcfg = SmithConfig(output_dir=str(work / "warm"), use_cpu=True, bf16=False, report_to="none",
                       warm_start_steps=p.warm_steps, warm_start_lr=3e-4 if p.quick else 1e-4,
                       warm_start_top_layers=10 if p.quick else 0, warm_start_use_share=p.warm_use_share,
                       per_device_train_batch_size=4, num_generations=4, build_examples=3, seed=0)
    wmodel, wtok = load_for_training(ModelConfig(model_name_or_path=DEFAULT_MODEL), output_dir=work)
    out: dict = {}
    for when in ("before", "after"):
        if when == "after":
            t1 = time.time()
            wmodel = warm_start(wcfg, wmodel, wtok, tasks.TRAIN_FAMILIES, work / "warm")
            out["warm_start_seconds"] = round(time.time() - t1, 1)
        ready_for_generation(wmodel)
        bv = build_verified_rate(local_generator(wmodel, wtok, max_new_tokens=p.build_max_new, batch_size=9),
                                 tasks.TRAIN_FAMILIES, attempts=1, examples=3, checks=4)
        out[f"build_verified_rate_{when}"], out[f"build_{when}"] = bv["rate"], bv
        print(f"build_verified_rate {when} warm start (training families, {bv['attempts']} attempts): "
              f"{bv['rate']:.3f}; failures " + ", ".join(f"{k} {v}" for k, v in bv["failures"].items()))
    if not p.quick:
        r = evaluate(local_generator(wmodel, wtok, max_new_tokens=p.max_new), tasks.HELDOUT_FAMILIES,
                     mode="reference", n=p.n)
        out.update(warm_reference_tools=r["macro"], per_family=r["per_family"], parse=r["call_parse_rate"],
                   sample_replies=r["sample_replies"], heldout_stats=heldout_stats(r))
        print(f"held-out macro acc warm_reference_tools: {r['macro']:.3f}; use call parse rate after warm "
              f"start {r['call_parse_rate']:.3f}")
    out["warm_part_seconds"] = round(time.time() - t0, 1)
    wmodel.save_pretrained(work / "warm" / "model")
    wtok.save_pretrained(work / "warm" / "model")
    return out


def grpo_config(work: Path, p: Preset, name: str, aggregation: str):
    """SMITH GRPO from the warm-started model: half of every step's prompts are use tasks, the pool starts with
    the training families' verified reference tools (the warm start's targets)."""
    from llmkit.train.smith.config import SmithConfig

    return SmithConfig(output_dir=str(work / name), use_cpu=True, bf16=False, report_to="none",
                       reward_aggregation=aggregation, max_steps=p.grpo_steps, per_device_train_batch_size=8,
                       num_generations=4, max_completion_length=p.build_max_new, temperature=0.8, learning_rate=1e-5,
                       beta=0.0, logging_steps=1, save_strategy="no", num_prompts=8 * p.grpo_steps,
                       gradient_checkpointing=False,  # 135M on CPU: memory is no issue, recomputation is
                       use_share=0.5, seed_pool="reference", build_examples=3, build_checks=4, eval_n=p.n,
                       eval_max_new_tokens=p.max_new, eval_build_max_new_tokens=p.build_max_new,
                       eval_no_tools=not p.quick, eval_reference=not p.quick or name == "smith",
                       dataloader_num_workers=0, seed=0)


def grpo_part(work: Path, p: Preset, name: str) -> dict:
    """``name`` is ``smith`` (axes normalized separately) or ``combined_reward`` (one summed scalar)."""
    from trl import ModelConfig

    from llmkit.train.smith.recipe import main as smith_main

    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    smith_main(grpo_config(work, p, name, "normalize_then_sum" if name == "smith" else "combined"),
               ModelConfig(model_name_or_path=str(work / "warm" / "model")))
    ev = json.loads((out / "eval.json").read_text())
    ref, tools = ev["after"]["reference_tools"], ev["after"]["with_tools"]
    d = {"macro": tools["macro"], "per_family": tools["per_family"], "heldout_stats": heldout_stats(tools),
         "use_fraction": ev.get("use_fraction"), "seeded_pool": ev.get("seeded_pool"),
         "reference_macro": ref["macro"] if ref else None, "parse": ev["after"]["use_call_parse_rate"],
         "sample_replies": tools["sample_replies"], "reference_sample_replies": ref["sample_replies"] if ref else None,
         "run": {"seconds": round(time.time() - t0, 1), "pool_size": ev["pool_size"],
                 "pool_growth": ev["pool_growth"], "heldout_builds": ev["after"]["built"],
                 "policy_no_tools_macro": (ev["after"]["no_tools"] or {}).get("macro"),
                 "curves": reward_curves(out / "metrics.jsonl")}}
    per_step = {k: "[" + ", ".join(f"{y:.2f}" for y in v[1]) + "]" for k, v in d["run"]["curves"].items() if v[1]}
    nt = d["run"]["policy_no_tools_macro"]
    print(f"held-out macro acc {name}: {d['macro']:.3f}"
          + (f" (policy without tools {nt:.3f})" if nt is not None else "")
          + (f" (policy with the reference tools {d['reference_macro']:.3f}, use call parse rate "
             f"{d['parse']:.3f})" if ref else "")
          + f"; training pool {ev['pool_size']} tools; per step "
          + ", ".join(f"{k} {v}" for k, v in per_step.items()))
    return d


def run_part(store: ResultStore, work: Path, p: Preset, name: str) -> dict:
    """Run one part and save it (``--only base`` ... in separate processes, then ``--only merge``)."""
    make = {"base": base_part, "warm": warm_part}.get(name)
    value = make(work, p) if make else grpo_part(work, p, name)
    return store.save(f"part_{name}", value)


def load_parts(store: ResultStore) -> tuple[dict, dict]:
    """``(parts, written)``: the saved parts by name and when each was written (UTC). Raises without base/smith."""
    parts = {k: v for k in PARTS if (v := store.load(f"part_{k}")) is not None}
    missing = {"base", "smith"} - set(parts)
    if missing:
        raise FileNotFoundError(f"missing parts {sorted(missing)} in {store.root}: run them with --only first")
    if "combined_reward" not in parts:
        print("combined_reward: not run (no part_combined_reward.json in the work folder); its keys are null")
    written = {k: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(store.path(f"part_{k}").stat().st_mtime))
               for k in parts}
    return parts, written


def frozen_student(work: Path, p: Preset) -> tuple[dict, dict | None]:
    """The warm-started policy, frozen before GRPO, on the held-out families with each writer's tools, the
    reference tools and none; and on the training families GRPO verified a tool for (its own builds only, the
    seeded reference tools left out) against answering those without tools. ``(student, training_pool)``;
    ``student["evals"]`` holds the four held-out evaluations, which ``merge`` turns into conditions."""
    from llmkit.models import load
    from llmkit.tools import ToolPool, tasks
    from llmkit.tools.evaluate import evaluate, local_generator
    from llmkit.train.smith.recipe import ready_for_generation

    model_dir = work / "warm" / "model"
    if not model_dir.is_dir():
        raise FileNotFoundError(f"no warm-started model in {model_dir} (the frozen student): run --only warm")
    model, tok = load(str(model_dir))
    gen = local_generator(ready_for_generation(model), tok, max_new_tokens=p.max_new, batch_size=16)
    fams = tasks.HELDOUT_FAMILIES
    spool, upool = ToolPool(work / "smith" / "eval_pool_after"), ToolPool(work / "untrained_pool")
    student = {"model": "the warm-started policy, frozen before GRPO", "smith_heldout_tools": spool.families(),
               "untrained_heldout_tools": upool.families()}
    evals = {"smith_tools": evaluate(gen, fams, pool=spool, n=p.n),
             "untrained_tools": evaluate(gen, fams, pool=upool, n=p.n),
             "reference_tools": evaluate(gen, fams, mode="reference", n=p.n),
             "no_tools": evaluate(gen, fams, mode="none", n=p.n)}
    student["evals"] = evals
    print(f"frozen student (warm start, before GRPO): with SMITH-written tools {evals['smith_tools']['macro']:.3f} "
          f"({len(spool.families())} held-out tools), with untrained-writer tools "
          f"{evals['untrained_tools']['macro']:.3f} ({len(upool.families())}), with the reference tools "
          f"{evals['reference_tools']['macro']:.3f} (call parse rate {evals['reference_tools']['call_parse_rate']:.3f})"
          f", without tools {evals['no_tools']['macro']:.3f}")
    policy_tools = [e for e in ToolPool(work / "smith" / "pool").entries() if e.source == "policy"]
    if not policy_tools:
        return student, None
    shutil.rmtree(work / "smith_policy_pool", ignore_errors=True)
    tpool = ToolPool(work / "smith_policy_pool")
    for e in policy_tools:
        tpool.add(e.spec, e.family, e.score, step=e.step, source=e.source)
    tf = tpool.families()
    r, r0 = evaluate(gen, tf, pool=tpool, n=p.n), evaluate(gen, tf, mode="none", n=p.n)
    print(f"frozen student on the {len(tf)} training families GRPO verified a tool for: with those tools "
          f"{r['macro']:.3f} vs without tools {r0['macro']:.3f} (call parse rate {r['call_parse_rate']:.3f})")
    return student, {"families": tf, "with_pool": r["macro"], "no_tools": r0["macro"],
                     "per_family_with_pool": r["per_family"], "per_family_no_tools": r0["per_family"],
                     "call_parse_rate": r["call_parse_rate"], "with_pool_stats": heldout_stats(r),
                     "no_tools_stats": heldout_stats(r0)}


def merge(parts: dict, written: dict, student: dict, student_train: dict | None, p: Preset,
          started: float) -> dict:
    """The bench's JSON from the parts and the frozen student's evaluations (``frozen_student``)."""
    from llmkit.models import DEFAULT_MODEL
    from llmkit.tools import tasks

    b, w = parts["base"], parts.get("warm", {})
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
    student = dict(student)
    for k, r in student.pop("evals").items():
        cond[f"student_{k}"], per_fam[f"student_{k}"], held[f"student_{k}"] = r["macro"], r["per_family"], heldout_stats(r)
        student[k] = heldout_stats(r)
    for k in [k for k in ("smith", "combined_reward", "untrained_writer", "reference_tools") if k in cond]:
        print(f"difference {k} - no_tools: {cond[k] - cond['no_tools']:+.3f}")
    for k in ("before", "after"):
        if f"build_verified_rate_{k}" in w:
            print(f"build_verified_rate {k} warm start: {w[f'build_verified_rate_{k}']:.3f}")
    return {"quick": p.quick, "model": DEFAULT_MODEL, "n_per_family": p.n, "grpo_steps": p.grpo_steps,
            "warm_start_steps": p.warm_steps, "max_new_tokens": p.max_new, "build_max_new_tokens": p.build_max_new,
            "heldout": list(tasks.HELDOUT_FAMILIES), "train_families": list(tasks.TRAIN_FAMILIES),
            "warm_start_seconds": w.get("warm_start_seconds"),
            "build_verified_rate_before": w.get("build_verified_rate_before"),
            "build_verified_rate_after": w.get("build_verified_rate_after"),
            "warm_builds": {k: w.get(f"build_{k}") for k in ("before", "after")}, "sandbox": b["sandbox"],
            "attacks": b["attacks"], "untrained_builds": b["untrained_builds"], "conditions": cond,
            "per_family": per_fam, "runs": runs, "use_call_parse_rate": parse, "sample_replies": samples,
            "student_training_pool": student_train, "student": student, "heldout_stats": held,
            "use_fraction": use_fraction, "seeded_pool": parts["smith"].get("seeded_pool"),
            "parts_written_utc": written, "merge_seconds": round(time.time() - started, 1)}


def summary(res: dict) -> dict:
    """The bench's last line: the headline figures of ``merge``'s JSON."""
    cond, held, parse, runs = res["conditions"], res["heldout_stats"], res["use_call_parse_rate"], res["runs"]
    student, train, ov = res["student"], res["student_training_pool"], res["sandbox"]
    return {"heldout_macro_acc": cond["smith"], "heldout_macro_acc_untrained_writer": cond["untrained_writer"],
            "heldout_macro_acc_no_tools": cond["no_tools"], "heldout_macro_acc_reference_tools": cond["reference_tools"],
            "heldout_macro_acc_combined_reward": cond.get("combined_reward"),
            "student_macro_acc_smith_tools": cond["student_smith_tools"],
            "student_macro_acc_untrained_tools": cond["student_untrained_tools"],
            "student_macro_acc_reference_tools": cond["student_reference_tools"],
            "student_macro_acc_no_tools": cond["student_no_tools"],
            "student_call_parse_rate": student["reference_tools"]["call_parse_rate"],
            "student_call_parse_rate_smith_tools": student["smith_tools"]["call_parse_rate"],
            "heldout_macro_acc_ci": held["smith"]["macro_ci"],
            "heldout_questions_per_family": held["smith"]["n_per_family"],
            "use_fraction": res["use_fraction"].get("smith"),
            "use_fraction_combined_reward": res["use_fraction"].get("combined_reward"),
            "heldout_macro_acc_warm_start_reference_tools": cond.get("warm_reference_tools"),
            "heldout_macro_acc_smith_reference_tools": cond.get("smith_reference_tools"),
            "use_call_parse_rate_base": parse["base"], "use_call_parse_rate_warm_start": parse.get("warm_start"),
            "use_call_parse_rate": parse.get("smith"),
            "build_verified_rate_before": res["build_verified_rate_before"],
            "build_verified_rate_after": res["build_verified_rate_after"],
            "pool_size": runs["smith"]["pool_size"],
            "pool_size_combined_reward": runs.get("combined_reward", {}).get("pool_size"),
            "student_macro_acc_smith_training_pool": train["with_pool"] if train else None,
            "student_macro_acc_training_families_no_tools": train["no_tools"] if train else None,
            "sandbox_p50_ms": round(ov["p50_ms"], 2), "sandbox_p95_ms": round(ov["p95_ms"], 2),
            "sandbox_overhead_ratio": round(ov["ratio"], 3),
            "sandbox_escapes": sum(not a["contained"] for a in res["attacks"].values())}


def plot(res: dict, png: Path) -> Path:
    """Held-out macro accuracy per condition, the reward axes per GRPO step, and the pool's growth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [k for k in PLOTTED if k in res["conditions"]]
    colors = {"no_tools": "gray", "reference_tools": "green", "warm_reference_tools": "olive", "smith": "C0",
              "combined_reward": "C1", "student_smith_tools": "C0"}
    axes[0].bar(range(len(names)), [res["conditions"][k] for k in names], color=[colors.get(k, "orange") for k in names])
    axes[0].set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    axes[0].set_ylabel("held-out macro accuracy")
    axes[0].set_title(f"held-out families (n={res['n_per_family']} each)")
    for name, run in res["runs"].items():
        for axis, style in (("schema_reward", "-"), ("code_reward", "--"), ("outcome_reward", ":"),
                            ("combined_reward", "-.")):
            xs, ys = run["curves"].get(axis, ([], []))
            if xs:
                axes[1].plot(xs, ys, style, marker=".", label=f"{name} {axis.split('_')[0]}")
        xs, ys = run["curves"].get("pool_size", ([], []))
        if xs:
            axes[2].plot(xs, ys, marker="o", label=name)
    for ax, title in ((axes[1], "reward axes per step"), (axes[2], "pool size (verified tools)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:  # a run without logged steps leaves the panel empty
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
