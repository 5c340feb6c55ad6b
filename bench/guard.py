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
5. Overhead, on the serving path. The fitted guard is saved and two `llmkit serve`
   subprocesses (transformers engine, 1 torch thread each) start: one plain, one with
   `--guard DIR --guard-action annotate`. A few test prompts are sent one request at a
   time, alternately to each server (so both see the same machine load), same
   greedy decoding: `latency_ratio` = total client latency with the guard / without.
   `cpu_ratio` is the same for the servers' CPU seconds (/proc, all threads). The
   served guard runs its whole teacher-forced pass after generation (the server's
   default; ``ServerConfig.guard_prefill`` would start the prompt part beside
   generation: on the busy 2-core machine --quick measured 1.361 with it and 1.332
   without, runs minutes apart, i.e. no gain for one more weight pass). In-process, on the same responses: seconds of the guard's whole
   pass (``Guard.check``) vs its prompt part (``Guard.prefill``) and its response part
   (``check(prefill=)``), whether the two paths give the same score, and the ratio the
   server would reach if the prompt part were hidden behind generation (a free core).

Sizes. `--quick`: the two safety tasks, 12 items per variant file, prompts <= 400
tokens, 40 new tokens, 6 latency requests. Full: + rule-following/single-turn,
16 items per variant file, prompts <= 768 tokens, 128 new tokens, 8 latency requests:
chosen so that one run fits a 25-minute slot of the shared 2-core machine at 1 torch
thread (the earlier 60 items x 160 tokens would take hours there). `--responses-cache`
keeps the generated responses, so a run cut by its slot can be resumed without
regenerating.

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
    p.add_argument("--limit", type=int, default=None, help="items per variant file (quick 12, full 16)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="quick 40, full 128")
    p.add_argument("--tasks", default=None, help="comma-separated IHEval tasks")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip samples with longer prompts (quick 400: the long Tensor Trust attacks dominate "
                   "CPU time; full 768)")
    p.add_argument("--components", type=int, default=16)
    p.add_argument("--target-fpr", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1: extra threads on the shared 2-core machine "
                   "oversubscribe and run ~20x slower)")
    p.add_argument("--latency-requests", type=int, default=None, help="quick 6, full 8")
    p.add_argument("--responses-cache", default=None,
                   help="JSON file: reuse the responses stored there for the same configuration, else "
                   "generate and store them (resume a run cut by its time slot)")
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
    threads = args.threads or 1
    torch.set_num_threads(threads)
    limit = args.limit or (12 if args.quick else 16)
    max_new = args.max_new_tokens or (40 if args.quick else 128)
    tasks = args.tasks.split(",") if args.tasks else (QUICK_TASKS if args.quick else FULL_TASKS)
    n_lat = args.latency_requests or (6 if args.quick else 8)
    t_start = time.time()

    model, tok = load(DEFAULT_MODEL)
    engine = HFEngine(model, tok, batch_size=8)
    params = GenerationParams(max_new_tokens=max_new, temperature=0.0)
    samples = iheval.load(args.data, tasks=tasks, settings=["aligned", "conflict"], limit=limit)
    samples = [s for s in samples if s["id"] not in iheval.INSTRUCTION_IDS]
    max_prompt = args.max_prompt_tokens or (400 if args.quick else 768)
    prompts = [iheval.render_prompt(tok, s) for s in samples]
    keep = [i for i, p in enumerate(prompts) if len(tok(p, add_special_tokens=False)["input_ids"]) <= max_prompt]
    samples, prompts = [samples[i] for i in keep], [prompts[i] for i in keep]
    msgs = [iheval.build_messages(s) for s in samples]
    print(f"# {len(samples)} IHEval samples from {', '.join(tasks)}; greedy, {max_new} new tokens", flush=True)

    # 1. responses and grades
    key = {"model": DEFAULT_MODEL, "max_new_tokens": max_new, "prompts": hashlib.sha256(
        json.dumps(prompts).encode()).hexdigest()}
    cache = Path(args.responses_cache) if args.responses_cache else None
    if cache and cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        texts = json.loads(cache.read_text())["texts"]
        print(f"# responses read from {cache}", flush=True)
    else:
        texts = generate_sorted(engine, prompts, params)
        if cache:
            cache.write_text(json.dumps({"key": key, "texts": texts}) + "\n")
    print(f"# responses ready at {time.time() - t_start:.0f} s", flush=True)
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

    print(f"# detection and correction done at {time.time() - t_start:.0f} s", flush=True)

    # 5. overhead on the serving path: `llmkit serve` with and without --guard, same prompts, same load
    lat_idx = sorted(test_idx, key=lambda i: len(prompts[i]))[:: max(1, len(test_idx) // n_lat)][:n_lat]
    lat = serving_overhead(guard, [msgs[i] for i in lat_idx], max_new, threads)
    res["latency_ratio"] = lat.pop("latency_ratio")
    res["cpu_ratio"] = lat.pop("cpu_ratio")
    # in-process: the guard's whole pass vs its prompt / response parts, on the server's own responses
    t_whole = t_pre = t_resp = 0.0
    max_dev = 0.0
    for m, text in zip([msgs[i] for i in lat_idx], lat["guard_texts"]):
        t0 = time.perf_counter()
        whole = guard.check(engine, m, text)
        t1 = time.perf_counter()
        pre = guard.prefill(engine, m)
        t2 = time.perf_counter()
        fast = guard.check(engine, m, text, prefill=pre)
        t3 = time.perf_counter()
        t_whole, t_pre, t_resp = t_whole + t1 - t0, t_pre + t2 - t1, t_resp + t3 - t2
        max_dev = max(max_dev, abs(whole["score"] - fast["score"]))
    lat.update(check_whole_s=t_whole, check_prefill_part_s=t_pre, check_response_part_s=t_resp,
               max_score_diff_prefill_vs_whole=max_dev)
    served_scores_equal = all(abs(a - b) <= 1e-3 for a, b in zip(
        lat["guard_scores"], [guard.check(engine, m, t)["score"] for m, t in zip([msgs[i] for i in lat_idx],
                                                                               lat["guard_texts"])]))
    lat["served_scores_equal_whole_pass"] = served_scores_equal
    # the served ratio if the prompt part ran hidden beside generation (a free core) and only the
    # response part were left after it: plain server latency + in-process response part, measured minutes apart
    res["latency_ratio_prompt_hidden_est"] = (lat["plain_s"] + t_resp) / lat["plain_s"]
    del lat["guard_texts"], lat["guard_scores"]

    counts = {
        "samples": len(samples), "fit_half": len(fit_idx), "test_half": len(test_idx),
        "fit_compliant_manifold": len(fit_ok) - n_hold, "fit_compliant_calibration": n_hold,
        "test_violations": sum(y), "test_compliant": len(y) - sum(y),
        "aligned_failures_excluded": sum(1 for l in labels if l is None),
        "test_flagged": len(flagged_test), "latency_requests": len(lat_idx),
        "latency_tokens_plain": lat["tokens_plain"], "latency_tokens_guard": lat["tokens_guard"],
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
    print(f"serving latency, llmkit serve --guard (annotate) / no guard, hf, 1 request at a time: "
          f"{res['latency_ratio']:.3f}  ({lat['guard_s']:.1f} s vs {lat['plain_s']:.1f} s over {len(lat_idx)} requests)")
    print(f"serving CPU seconds, guard / no guard: {res['cpu_ratio']:.3f}  ({lat['cpu_guard_s']:.1f} s vs "
          f"{lat['cpu_plain_s']:.1f} s)")
    print(f"estimated latency ratio if the prompt part were hidden beside generation (plain server + in-process "
          f"response part): {res['latency_ratio_prompt_hidden_est']:.3f}")
    print(f"guard pass in-process over the same {len(lat_idx)} answers: whole {lat['check_whole_s']:.2f} s, "
          f"prompt part {lat['check_prefill_part_s']:.2f} s + response part {lat['check_response_part_s']:.2f} s; "
          f"max |score diff| {lat['max_score_diff_prefill_vs_whole']:.2e}; served scores equal whole pass: "
          f"{lat['served_scores_equal_whole_pass']}")
    print(f"counts: {json.dumps(counts)}")

    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / ("guard_quick.json" if args.quick else "guard.json")
    full = {"figures": res, "iheval_per_task": per_task, "latency": lat, "pass_rate_by_setting": per_setting_pass,
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


class _Server:
    """`llmkit serve` as a subprocess on loopback (log in a temp file, named if it fails)."""

    def __init__(self, extra: list[str], threads: int):
        import socket
        import subprocess
        import tempfile

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - kept open as the server's log
            "w+", prefix="llmkit-guard-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "llmkit.cli", "serve", "--port", str(port), "--threads", str(threads),
               "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[1])
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; log: {self.log.name}")
            time.sleep(1)

    def cpu_s(self) -> float:
        import os

        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads

    def ask(self, messages, max_tokens: int) -> tuple[float, float, dict]:
        import httpx

        c0, t0 = self.cpu_s(), time.perf_counter()
        r = httpx.post(self.url + "/v1/chat/completions", timeout=None,
                       json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t0, self.cpu_s() - c0, r.json()

    def stop(self):
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serving_overhead(guard, messages_list, max_tokens: int, threads: int) -> dict:
    """Client latency and server CPU of `llmkit serve` with and without the guard, same prompts, alternating."""
    import tempfile

    from llmkit.models import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as d:
        guard.save(d)
        plain = guarded = None
        try:
            plain = _Server(["--model", DEFAULT_MODEL], threads)
            guarded = _Server(["--model", DEFAULT_MODEL, "--guard", d, "--guard-action", "annotate"], threads)
            for srv in (plain, guarded):  # warm-up: lazy initialisation is not overhead
                srv.ask(messages_list[0], 8)
            out = {"plain_s": 0.0, "guard_s": 0.0, "cpu_plain_s": 0.0, "cpu_guard_s": 0.0, "tokens_plain": 0,
                   "tokens_guard": 0, "per_request": [], "guard_texts": [], "guard_scores": []}
            for j, m in enumerate(messages_list):
                order = [("plain", plain), ("guard", guarded)]
                if j % 2:  # alternate so that neither side always runs second
                    order.reverse()
                row = {}
                for name, srv in order:
                    dt, cpu, body = srv.ask(m, max_tokens)
                    out[f"{name}_s"] += dt
                    out[f"cpu_{name}_s"] += cpu
                    out[f"tokens_{name}"] += body["usage"]["completion_tokens"]
                    row[name] = round(dt, 3)
                    if name == "guard":
                        out["guard_texts"].append(body["choices"][0]["message"]["content"])
                        out["guard_scores"].append(body["choices"][0]["guard"]["score"])
                out["per_request"].append(row)
        finally:
            for srv in (plain, guarded):
                if srv is not None:
                    srv.stop()
    out["latency_ratio"] = out["guard_s"] / out["plain_s"]
    out["cpu_ratio"] = out["cpu_guard_s"] / max(out["cpu_plain_s"], 1e-9)
    return out


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
