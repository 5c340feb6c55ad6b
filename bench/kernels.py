"""Hawkeye kernel workbench benchmark: strategy tests, verifier bad/good sets, the project's kernels.

Figures (library code in ``llmkit/kernels/workbench/report.py``):

- strategy tests per architecture: how many strategies of ``kernels/taxonomy/<arch>.yaml`` pass
  their test (correct under Triton's interpreter on CPU, natively on a GPU of that kind; the
  strategy present in the code compiled for the target; the broken twin caught);
- the verifier against its bad-candidate set (wrong on a non-example shape, zero output, cached
  output, torch fallback, infinite loop): how many it rejects, and against correct candidates:
  how many it accepts;
- the verifier against the adversarial candidates of ``tests/kernels/exploits/`` (forged verdict,
  switched-off recorder, popped dispatch modes, the reference fished out, input mutation, aliased,
  NaN and constant outputs, a numpy escape, a host file write, a loopback connection, host
  secrets): how many it rejects with nothing escaping, judged from outside as well;
- per kernel (the good candidates and the project's own kernels: InQuant quantize/pack and
  unpack/dequantize, the ZO low-rank perturbation): correctness, the strategies found in the code
  compiled for each target, and on a GPU the speedup over eager PyTorch and over ``torch.compile``
  (``null`` without a GPU: the timing path exists in ``workbench/timing.py`` but needs CUDA events);
- the full run also drives the generation loop against a scripted endpoint (one wrong kernel, then
  a right one) and records whether it ends with a verified kernel.

    .venv/bin/python bench/kernels.py --quick    # one trial per shape, no generation loop
    .venv/bin/python bench/kernels.py            # two trials per shape + the scripted generation loop

Writes ``bench/results/kernels[_quick].json`` and a PNG next to it; ``--quick`` ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
EXPLOITS = Path(__file__).resolve().parents[1] / "tests" / "kernels" / "exploits"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one trial per shape, skip the generation loop")
    ap.add_argument("--arch", default="hopper", help="architecture the verifier checks against (default hopper)")
    ap.add_argument("--parallel", type=int, default=3, help="verifier subprocesses at once")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from llmkit.kernels.workbench import report
    from llmkit.kernels.workbench.compiled import ARCHS

    trials = 1 if args.quick else 2
    t0 = time.time()
    suite = report.run_strategy_suite()
    for arch, r in suite["per_arch"].items():
        print(f"strategy tests {arch}: {r['passed']}/{r['total']} pass" + (f" (failed: {', '.join(r['failed'])})"
                                                                           if r["failed"] else ""))
    bad = report.verify_set(report.BAD_CANDIDATES, args.arch, trials=trials, timeout=90, parallel=args.parallel)
    for name, r in bad.items():
        print(f"verifier bad '{name}': {'rejected' if not r['correct'] else 'ACCEPTED'} -- "
              f"{(r['reasons'] or ['no reason'])[0][:110]}")
    exploits = report.run_exploits(EXPLOITS, args.arch, trials=trials, timeout=300, parallel=args.parallel)
    for name, r in exploits.items():
        verdict = "rejected" if r["rejected"] else "ACCEPTED"
        print(f"verifier exploit '{name}': {verdict}, {'contained' if r['contained'] else 'ESCAPED'} -- "
              f"{(r['escaped'] or r['reasons'] or ['no reason'])[0][:110]}")
    kernels = report.verify_set(report.GOOD_CANDIDATES + report.PROJECT_KERNELS, args.arch, trials=trials,
                                parallel=args.parallel, strategies_for=ARCHS)
    good_names = [n for n, *_ in report.GOOD_CANDIDATES]
    for name, r in kernels.items():
        by_arch = "; ".join(f"{a}: {','.join(s) or '-'}" for a, s in (r.get("strategies_by_arch") or {}).items())
        sp = "n/a (no GPU)" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        spc = "n/a (no GPU)" if r.get("speedup_vs_compile") is None else f"{r['speedup_vs_compile']:.2f}x"
        print(f"kernel '{name}': correct={r['correct']} max_abs_err={r['max_abs_err']} speedup_vs_eager={sp} "
              f"speedup_vs_compile={spc} strategies [{by_arch}]")
    out = {
        "quick": args.quick, "arch": args.arch, "trials": trials,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)",
        "strategy_tests": suite,
        "verifier_bad": bad, "verifier_exploits": exploits, "kernels": kernels,
        "strategy_tests_passed": suite["passed"], "strategy_tests_total": suite["total"],
        "verifier_bad_rejected": sum(not r["correct"] for r in bad.values()), "verifier_bad_total": len(bad),
        # an exploit counts as rejected when the verdict says so and nothing escaped to the host
        "verifier_exploits_rejected": sum(r["handled"] for r in exploits.values()),
        "verifier_exploits_total": len(exploits),
        "verifier_good_accepted": sum(bool(kernels[n]["correct"]) for n in good_names),
        "verifier_good_total": len(good_names),
        "project_kernels_correct": sum(bool(kernels[n]["correct"]) for n, *_ in report.PROJECT_KERNELS),
        "project_kernels_total": len(report.PROJECT_KERNELS),
    }
    if not args.quick:
        from llmkit.kernels.workbench.generate import generate, scripted_endpoint

        fx = report.FIXTURES
        replies = ["```python\n" + (fx / "bad_example_shape.py").read_text() + "```",
                   "```python\n" + (fx / "good_softmax.py").read_text() + "```"]
        with tempfile.TemporaryDirectory() as tmp, scripted_endpoint(replies) as url:
            s = generate(fx / "ref_softmax.py", args.arch, url, "scripted", tmp, budget=2, candidates=1, parallel=1,
                         trials=1, progress=False)
        out["generate_scripted"] = {k: s[k] for k in ("n_candidates", "n_correct", "n_errors", "rounds")} | {
            "best_round": s["best"]["round"] if s["best"] else None}
        print(f"generation loop (scripted endpoint): {s['n_correct']}/{s['n_candidates']} candidates verified, "
              f"best from round {out['generate_scripted']['best_round']}")
    out["wall_s"] = round(time.time() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    stem = "kernels_quick" if args.quick else "kernels"
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=2))
    _plot(out, RESULTS / f"{stem}.png")
    keys = ("strategy_tests_passed", "strategy_tests_total", "verifier_bad_rejected", "verifier_bad_total",
            "verifier_exploits_rejected", "verifier_exploits_total", "verifier_good_accepted", "verifier_good_total", "project_kernels_correct", "project_kernels_total")
    print(json.dumps({k: out[k] for k in keys}))
    return 0


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = out["strategy_tests"]["per_arch"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
    archs = list(per)
    a.bar(archs, [per[x]["total"] for x in archs], color="#ddd", label="strategies in taxonomy")
    a.bar(archs, [per[x]["passed"] for x in archs], color="#3a7", label="tests pass (CPU)")
    a.set_title("strategy tests per architecture")
    a.legend(fontsize=8)
    labels = ["bad rejected", "exploits rejected", "good accepted", "project kernels correct"]
    vals = [(out["verifier_bad_rejected"], out["verifier_bad_total"]),
            (out["verifier_exploits_rejected"], out["verifier_exploits_total"]),
            (out["verifier_good_accepted"], out["verifier_good_total"]),
            (out["project_kernels_correct"], out["project_kernels_total"])]
    b.bar(labels, [t for _, t in vals], color="#ddd")
    b.bar(labels, [v for v, _ in vals], color="#37a")
    b.set_title("verifier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
