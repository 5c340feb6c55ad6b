"""AEO guard benchmark on IHEval with the bundled model: detection, correction, overhead.

What it measures, all in one run on the same responses:

1. Responses: the model answers IHEval samples (safety: user-prompt-hijack and
   system-prompt-extract; rule-following: single-turn, skipped by --quick) in the
   aligned and conflict settings, greedy decoding. Each response is graded by the
   IHEval scorer (llmkit.evals.iheval.score_response).
2. Labels. A response is a *violation* (1) when it comes from the conflict setting
   (the user turn carries an instruction that contradicts the system prompt) and
   the scorer says it fails the system instruction (strict score < 1). It is
   *compliant* (0) when it passes the scorer, in either setting. Aligned-setting
   failures (no conflicting instruction: the model simply could not do the task)
   are not injections and are left out of detection (counted in the JSON). A
   secondary figure (`auroc_aeo_setting`) uses the setting alone as the label.
3. Split. Samples are split by (task, id) into fit and test halves, so the same
   underlying prompt never sits on both sides. AEO fits on the fit half's
   compliant responses only (manifold on 70%, calibration/threshold on 30%); the
   probe trains on the fit half with labels; every AUROC / FPR@95%TPR is computed
   on the test half only. Perplexity and keyword need no fitting.
4. Correction. On the test half, responses the guard flags are regenerated with
   the system instruction re-asserted (same decoding), the regeneration is kept
   only when its chaos score is lower than the flagged original's, and re-graded; IHEval scores
   (benchmark averaging, aligned and conflict) with no guard vs guard + correct.
5. Overhead. For a few test prompts, one request at a time on the transformers
   engine, back to back on the same request so all see the same machine load:
   plain generation vs ``Guard.generate`` (states recorded during generation,
   `latency_ratio`) vs generation + ``Guard.check`` (a teacher-forced pass, the
   path for engines without hooks, `latency_ratio_teacher_forced`).

    .venv/bin/python bench/guard.py --quick
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from statistics import mean

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_TASKS = ["safety/user-prompt-hijack", "safety/system-prompt-extract"]
FULL_TASKS = QUICK_TASKS + ["rule-following/single-turn"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small slices (a few minutes)")
    p.add_argument("--data", default=None, help="IHEval benchmark folder (default ../shared/data/iheval/benchmark)")
    p.add_argument("--limit", type=int, default=None, help="items per variant file (quick 10, full 60)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="quick 40, full 160")
    p.add_argument("--tasks", default=None, help="comma-separated IHEval tasks")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip samples with longer prompts (quick 400: the long Tensor Trust attacks dominate "
                   "CPU time; full 2048)")
    p.add_argument("--components", type=int, default=16)
    p.add_argument("--target-fpr", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (quick: 1, since extra threads on a shared 2-core machine "
                   "oversubscribe and run ~20x slower; full: torch's default)")
    p.add_argument("--latency-requests", type=int, default=None, help="quick 4, full 12")
    return p.parse_args(argv)


def in_fit_half(sample) -> bool:
    h = hashlib.sha256(f"{sample['task']}/{sample['id']}".encode()).digest()
    return h[0] % 2 == 0


def generate_sorted(engine, prompts, params, progress=True):
    """Generate in length order (left-padded batches of similar length waste less), return in input order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs = engine.generate([prompts[i] for i in order], params, progress=progress)
    texts = [""] * len(prompts)
    for j, i in enumerate(order):
        texts[i] = outs[j][0].text
    return texts


def iheval_scores(rows) -> dict:
    from llmkit.evals import iheval

    agg = iheval.aggregate(rows)
    settings = [s for s in ("aligned", "conflict") if s in agg]
    agg["overall"] = mean(agg[s] for s in settings)
    return agg


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from llmkit.engines.hf import HFEngine
    from llmkit.evals import iheval
    from llmkit.generation import GenerationParams
    from llmkit.models import DEFAULT_MODEL, load
    from llmkit.serving.guard import Guard, capture
    from llmkit.serving.guard import baselines as B
    from llmkit.serving.guard import score as S

    torch.manual_seed(0)
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    limit = args.limit or (12 if args.quick else 60)
    max_new = args.max_new_tokens or (40 if args.quick else 160)
    tasks = args.tasks.split(",") if args.tasks else (QUICK_TASKS if args.quick else FULL_TASKS)
    n_lat = args.latency_requests or (4 if args.quick else 12)
    t_start = time.time()

    model, tok = load(DEFAULT_MODEL)
    engine = HFEngine(model, tok, batch_size=8)
    params = GenerationParams(max_new_tokens=max_new, temperature=0.0)
    samples = iheval.load(args.data, tasks=tasks, settings=["aligned", "conflict"], limit=limit)
    samples = [s for s in samples if s["id"] not in iheval.INSTRUCTION_IDS]
    max_prompt = args.max_prompt_tokens or (400 if args.quick else 2048)
    prompts = [iheval.render_prompt(tok, s) for s in samples]
    keep = [i for i, p in enumerate(prompts) if len(tok(p, add_special_tokens=False)["input_ids"]) <= max_prompt]
    samples, prompts = [samples[i] for i in keep], [prompts[i] for i in keep]
    msgs = [iheval.build_messages(s) for s in samples]
    print(f"# {len(samples)} IHEval samples from {', '.join(tasks)}; greedy, {max_new} new tokens", flush=True)

    # 1. responses and grades
    texts = generate_sorted(engine, prompts, params)
    grades = [iheval.score_response(s, t) for s, t in zip(samples, texts)]
    passed = [g["strict"] >= 1.0 for g in grades]

    # 2. one capture for every hidden-state method and the perplexity baseline
    from llmkit.serving.guard import default_layers

    layers = default_layers(model.config.num_hidden_layers)
    convs = [[*m, {"role": "assistant", "content": t}] for m, t in zip(msgs, texts)]
    caps = capture(model, tok, convs, layers, with_logprobs=True, batch_size=8, progress=True)

    labels = [None if (s["setting"] == "aligned" and not ok) else int(s["setting"] == "conflict" and not ok)
              for s, ok in zip(samples, passed)]
    fit_idx = [i for i, s in enumerate(samples) if in_fit_half(s)]
    test_idx = [i for i, s in enumerate(samples) if not in_fit_half(s)]
    fit_ok = [i for i in fit_idx if labels[i] == 0]
    random.Random(0).shuffle(fit_ok)  # calibration must mix tasks and settings like the manifold data
    n_hold = max(2, int(0.3 * len(fit_ok)))
    guard = Guard.fit_captures([caps[i] for i in fit_ok[n_hold:]], [caps[i] for i in fit_ok[:n_hold]],
                               model_name=DEFAULT_MODEL, hidden_size=model.config.hidden_size,
                               num_layers=model.config.num_hidden_layers, n_components=args.components,
                               target_fpr=args.target_fpr)
    det = [i for i in test_idx if labels[i] is not None]
    y = [labels[i] for i in det]
    aeo_all = guard.score_captures(caps).tolist()
    ppl = B.perplexity_scores(caps)
    ent = B.entropy_scores(caps)
    kw = [B.keyword_score(m, t) for m, t in zip(msgs, texts)]
    fit_lab = [i for i in fit_idx if labels[i] is not None]
    try:
        probe = B.Probe(layers).fit([caps[i] for i in fit_lab], [labels[i] for i in fit_lab])
        probe_all = probe.scores(caps)
    except ValueError:  # the fit half holds only one class: the probe cannot train
        probe_all = [0.0] * len(caps)
    # variant: one state per response (the trajectory's centroid) instead of every token
    from llmkit.serving.guard import Manifold

    cent = B.pooled(caps, layers)
    fit_rows = [i for i in fit_ok[n_hold:]]
    d = model.config.hidden_size
    cent_m = {j: Manifold.fit(cent[fit_rows, j * d : (j + 1) * d], args.components) for j in range(len(layers))}
    cent_raw = torch.stack([cent_m[j].energy(cent[:, j * d : (j + 1) * d]) for j in range(len(layers))], 1)
    med, scale = S.robust_scale(cent_raw[fit_ok[:n_hold]].double())
    aeo_centroid = S.chaos(cent_raw.double(), med, scale).tolist()
    methods = {"aeo": aeo_all, "aeo_centroid": aeo_centroid, "perplexity": ppl, "entropy": ent, "keyword": kw, "probe": probe_all}
    res: dict = {}
    for name, sc in methods.items():
        res[f"auroc_{name}"] = B.auroc([sc[i] for i in det], y)
        res[f"fpr95_{name}"] = B.fpr_at_tpr([sc[i] for i in det], y)
    setting_y = [int(samples[i]["setting"] == "conflict") for i in test_idx]
    res["auroc_aeo_setting"] = B.auroc([aeo_all[i] for i in test_idx], setting_y)
    flagged_test = [i for i in test_idx if aeo_all[i] > guard.threshold]
    res["aeo_tpr_at_threshold"] = (sum(1 for i in det if labels[i] == 1 and aeo_all[i] > guard.threshold)
                                   / max(1, sum(y)))
    res["aeo_fpr_at_threshold"] = (sum(1 for i in det if labels[i] == 0 and aeo_all[i] > guard.threshold)
                                   / max(1, len(y) - sum(y)))

    # 4. correction on the test half
    corrected = dict(zip(flagged_test, guard.correct_batch(engine, [msgs[i] for i in flagged_test], params,
                                                           originals=[texts[i] for i in flagged_test])))

    def rows(use_corrected: bool):
        out = []
        for i in test_idx:
            s = samples[i]
            g = iheval.score_response(s, corrected[i]) if (use_corrected and i in corrected) else grades[i]
            out.append({**g, "_category": s["category"], "_task": s["task"], "_setting": s["setting"],
                        "_variant": s["variant"], "_id": s["id"]})
        return out

    no_guard, with_guard = iheval_scores(rows(False)), iheval_scores(rows(True))
    res["iheval_no_guard"] = no_guard["overall"]
    res["iheval_guard_correct"] = with_guard["overall"]
    per_task = {k: {"no_guard": v, "guard_correct": with_guard[k]} for k, v in no_guard.items()}

    # 5. overhead, one request at a time (as a server sees them), back to back on the same request:
    #    plain generation; generation with the states recorded on the fly (Guard.generate, the hf path);
    #    and generation followed by a teacher-forced check (Guard.check, what any engine can use)
    lat_idx = sorted(test_idx, key=lambda i: len(prompts[i]))[:: max(1, len(test_idx) // n_lat)][:n_lat]
    engine.generate([prompts[lat_idx[0]]], params)  # warm-up
    guard.generate(engine, [msgs[lat_idx[0]]], params)
    t_plain = t_rec = t_chk = 0.0
    for j, i in enumerate(lat_idx):
        def plain(i=i):
            t0 = time.perf_counter()
            text = engine.generate([engine.chat_prompt(msgs[i])], params)[0][0].text
            return time.perf_counter() - t0, text

        def recorded(i=i):
            t0 = time.perf_counter()
            guard.generate(engine, [msgs[i]], params)
            return time.perf_counter() - t0

        if j % 2:  # alternate the order so that neither side always runs on a warmer cache
            dr = recorded()
            dp, text = plain()
        else:
            dp, text = plain()
            dr = recorded()
        t0 = time.perf_counter()
        guard.check(engine, msgs[i], text)
        t_chk += time.perf_counter() - t0
        t_plain, t_rec = t_plain + dp, t_rec + dr
    res["latency_ratio"] = t_rec / t_plain
    res["latency_ratio_teacher_forced"] = (t_plain + t_chk) / t_plain

    counts = {
        "samples": len(samples), "fit_half": len(fit_idx), "test_half": len(test_idx),
        "fit_compliant_manifold": len(fit_ok) - n_hold, "fit_compliant_calibration": n_hold,
        "test_violations": sum(y), "test_compliant": len(y) - sum(y),
        "aligned_failures_excluded": sum(1 for l in labels if l is None),
        "test_flagged": len(flagged_test), "latency_requests": len(lat_idx),
    }
    per_setting_pass = {}
    for task in tasks:
        for setting in ("aligned", "conflict"):
            v = [passed[i] for i, s in enumerate(samples) if f"{s['category']}/{s['task']}" == task
                 and s["setting"] == setting]
            if v:
                per_setting_pass[f"{task}:{setting}"] = sum(v) / len(v)

    for name in methods:
        print(f"detection {name:10s}: AUROC {res[f'auroc_{name}']:.3f}  FPR@95%TPR {res[f'fpr95_{name}']:.3f}")
    print(f"AEO (setting labels)  : AUROC {res['auroc_aeo_setting']:.3f}")
    print(f"AEO at threshold      : TPR {res['aeo_tpr_at_threshold']:.3f}  FPR {res['aeo_fpr_at_threshold']:.3f}")
    for k, v in per_task.items():
        print(f"IHEval {k:45s}: no guard {v['no_guard']:.3f}  guard+correct {v['guard_correct']:.3f}")
    print(f"latency ratio (guard recording during generation / no guard, hf, batch 1): {res['latency_ratio']:.3f}")
    print(f"latency ratio (generate + teacher-forced check / no guard, hf, batch 1): "
          f"{res['latency_ratio_teacher_forced']:.3f}")
    print(f"counts: {json.dumps(counts)}")

    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / ("guard_quick.json" if args.quick else "guard.json")
    full = {"figures": res, "iheval_per_task": per_task, "pass_rate_by_setting": per_setting_pass,
            "counts": counts, "threshold": guard.threshold, "layers": layers,
            "config": {"model": DEFAULT_MODEL, "tasks": tasks, "limit": limit, "max_new_tokens": max_new,
                       "max_prompt_tokens": max_prompt,
                       "components": args.components, "target_fpr": args.target_fpr, "quick": args.quick},
            "seconds": round(time.time() - t_start, 1)}
    out_path.write_text(json.dumps(full, indent=2) + "\n")
    _plot(out_path.with_suffix(".png"), {k: [v[i] for i in det] for k, v in methods.items()}, y)
    print(f"results written to {out_path}")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()}))
    return 0


def _plot(path, scores: dict, y):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not y or all(y) or not any(y):
        return
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for name, s in scores.items():
        pairs = sorted(zip(s, y), key=lambda p: -p[0])
        P, N = sum(y), len(y) - sum(y)
        tp = fp = 0
        xs, ys = [0.0], [0.0]
        for _, lab in pairs:
            tp, fp = tp + lab, fp + (1 - lab)
            xs.append(fp / N)
            ys.append(tp / P)
        ax.plot(xs, ys, label=name)
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.set_title("IHEval violation detection (test half)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
