"""The GPU-only measurements in one prepared run (~8 minutes of one H100/H200); see llmkit/experiments/gpu.py.

    python bench/gpu.py                  # every measurement, sized to --budget-s (default 480 s)
    python bench/gpu.py --quick          # a quarter of the sizes (a first look, ~2-3 minutes)
    python bench/gpu.py --budget-s 300   # trim the sizes (and skip what no longer fits) to 5 minutes
    python bench/gpu.py --only lqzo_int2 # one or more measurements (comma-separated)

Measures (each against its anchor in the same run): Hawkeye kernel speedups over eager PyTorch and
torch.compile (CUDA events, L2 flushed); InQuant decode tokens/s and capacity vs the bf16 cache at
long contexts on the hf engine; served throughput of `llmkit serve` with the hf and the vLLM engine
under vLLM's own benchmark client (vllm.benchmarks.serve); LQZO vs QZO at INT2 at GPU step counts.
Writes bench/results/gpu.json (after each measurement, so a cut run keeps what it measured); prints
one line per measurement and, last, one JSON line.

Without a GPU it says so, rehearses its own plumbing on CPU with the tiny model (nothing is timed
and no results file is written) and exits 0; the last line then names every measurement it would
take, with "device": "cpu".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
RESULTS = ROOT / "bench" / "results"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def _only(text: str) -> list[str]:
    from llmkit.experiments.gpu import MEASUREMENTS

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in MEASUREMENTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown measurement(s) {', '.join(bad) or '(none)'}; "
                                         f"choose from {', '.join(MEASUREMENTS)}")
    return names


def main(argv=None) -> int:
    from llmkit.cli_types import positive_float

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the sizes")
    ap.add_argument("--budget-s", type=positive_float, default=480.0, help="seconds the whole run may take (default 480)")
    ap.add_argument("--only", type=_only, default=None, help="comma-separated measurements to take")
    ap.add_argument("--model", default=None, help="model for decode and serving (default: the bundled model)")
    ap.add_argument("--gsm8k-dir", default=str(GSM8K), help="folder with GSM8K train.jsonl/test.jsonl (LQZO)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/gpu[_quick].json)")
    args = ap.parse_args(argv)

    import torch

    from llmkit.experiments import gpu

    settings = gpu.plan(args.budget_s, args.quick)
    names = args.only or list(gpu.MEASUREMENTS)
    if not torch.cuda.is_available():
        print("no CUDA/ROCm device: nothing can be measured here; rehearsing the plumbing on CPU "
              "(tiny model, nothing timed, no results file)", flush=True)
        with tempfile.TemporaryDirectory(prefix="llmkit-gpu-dry-") as tmp:
            rehearsal = gpu.dry_run(settings, Path(tmp), data_dir=args.gsm8k_dir)
        for name in names:
            print(f"{name}: would measure with {settings[name]} -- CPU rehearsal: {rehearsal[name]}", flush=True)
        print(json.dumps({"device": "cpu", "dry_run": True, "budget_s": args.budget_s, "quick": args.quick,
                          "measurements": names, "plan": {n: settings[n] for n in names},
                          "rehearsal": {n: rehearsal[n] for n in names}}))
        return 0
    out = Path(args.out) if args.out else RESULTS / ("gpu_quick.json" if args.quick else "gpu.json")
    res = gpu.run(settings, out, args.budget_s, model=args.model or gpu.MODEL, data_dir=args.gsm8k_dir,
                  only=names, log=lambda s: print(s, flush=True))
    summary = {"device": res["device"], "wall_s": res["wall_s"], "results": str(out.relative_to(ROOT))
               if out.is_relative_to(ROOT) else str(out), "measurements": names,
               "errors": [n for n, r in res["results"].items() if "error" in r],
               "skipped": [n for n, r in res["results"].items() if "skipped" in r]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
