"""KV-cache quantization benchmark: InQuant vs the unquantized cache, KIVI-4bit and an outlier buffer.

Run: ``.venv/bin/python bench/kv_cache.py [--quick]`` (bundled SmolLM2-135M, CPU). The full run
can be split into pieces that each fit a time slot: ``--part core`` (compression, perplexity,
quant speed, decode), then ``--part acc --acc-start S [--budget-min M]`` as often as needed (each
stops before a batch that would overrun ``M`` minutes and records how many problems it did; the
next starts where it stopped), then ``--merge`` prints every figure and writes kv_cache.json.
Parts are kept in results/kv_cache_parts/ (kv_cache_quick_parts/ with --quick) with the settings
that made them: give every part and the merge the same flags (but --part, --acc-start, --budget-min);
rerunning a command that was cut short continues after its last saved section or GSM8K batch.

What each figure measures: ``llmkit.experiments.kv_cache``; the figures: results/kv_cache.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from llmkit.experiments import kv_cache as kvx
from llmkit.experiments.harness import ResultStore, write_json

DATA = ROOT.parent / "shared" / "data" / "gsm8k"
MATH500 = ROOT.parent / "shared" / "data" / "math500" / "test.jsonl"
RESULTS = ROOT / "bench" / "results"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer problems, shorter runs")
    ap.add_argument("--part", choices=["all", "core", "acc"], default="all",
                    help="core: compression, perplexity, quant speed, decode -> kv_cache_parts/core.json; "
                         "acc: GSM8K accuracy from --acc-start -> kv_cache_parts/acc_<start>.json; "
                         "all: everything in one process")
    ap.add_argument("--merge", action="store_true",
                    help="combine kv_cache_parts/*.json into kv_cache.json (runs nothing)")
    ap.add_argument("--model", default=None, help="model name/path (default: the bundled model)")
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--shots", type=int, help="train exemplars before each scored question")
    ap.add_argument("--ppl-n", type=int, default=None, help="GSM8K test problems scored (default 8 quick, 40 full)")
    ap.add_argument("--acc-n", type=int, default=None, help="GSM8K test problems generated (default 6 quick, 32 full)")
    ap.add_argument("--acc-start", type=int, default=0, help="first GSM8K test problem of the accuracy run")
    ap.add_argument("--acc-names", default=None,
                    help="caches compared on GSM8K (default bf16,inquant,kivi with --quick, else bf16,inquant)")
    ap.add_argument("--acc-batch", type=int)
    ap.add_argument("--budget-min", type=float, default=None,
                    help="stop the accuracy run before a batch that would end after this many minutes")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="GSM8K generation cap (default 96 quick, 256 full)")
    ap.add_argument("--compress-len", type=int)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: ppl,acc,speed,decode,arms,capacity,serve,quanto "
                                                  "(quanto: transformers' QuantizedCache, which compiles optimum-quanto's extension on first use)")
    ap.add_argument("--calib-texts", type=int, default=None, help="GSM8K train texts (4 exemplars each) to calibrate on")
    ap.add_argument("--recalibrate", action="store_true",
                    help="calibrate even if a calibration file exists (and start the part afresh)")
    ap.add_argument("--long-ctx", type=int, help="long-context tokens read back from the cache")
    ap.add_argument("--long-tgt", type=int, help="tokens scored after the long context")
    ap.add_argument("--long-windows", type=int, default=None, help="long-context texts (default 1 quick, 4 full)")
    ap.add_argument("--cap-len", type=int, help="sequence length of the capacity figure")
    ap.add_argument("--bytes-len", type=int,
                    help="prefill length at which bytes/token are measured (a multiple of --group-size: whole groups)")
    ap.add_argument("--cap-gib", type=float, help="KV budget (GiB) of the capacity figure")
    ap.add_argument("--serve-n", type=int, default=None, help="requests served at the KV budget (default 12 quick, 16 full)")
    ap.add_argument("--serve-new", type=int, default=None,
                    help="most new tokens per served request (default 32 quick, 64 full; requests cycle through "
                         "1, 1/2, 3/4, 1/4 of it)")
    ap.add_argument("--serve-gap", type=float,
                    help="seconds between served requests' arrivals after the first --serve-bf16-rows (default 1)")
    ap.add_argument("--serve-bf16-rows", type=int,
                    help="the served KV budget: what this many bf16 sequences of prompt+new tokens hold")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the figure lines of a results file this script wrote and plot it next to it "
                         "(runs nothing)")
    ap.set_defaults(**kvx.DEFAULTS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        res = json.loads(Path(args.report).read_text())
        print(json.dumps(kvx.report(res)))
        kvx.write_plot(res, Path(args.report))
        return 0
    cfg = kvx.settings(vars(args))
    store = ResultStore(RESULTS / ("kv_cache_quick_parts" if args.quick else "kv_cache_parts"), cfg,
                        fresh=args.recalibrate and not args.merge)
    out = RESULTS / ("kv_cache_quick.json" if args.quick else "kv_cache.json")
    if args.merge:
        res = kvx.merge_parts(store)
        res["figures"] = kvx.report(res)
        write_json(out, res)
    else:
        from llmkit.models import load

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model, tok = load(args.model)
        model.eval()
        whole = args.part == "all"
        res = kvx.run(model, tok, cfg, gsm8k=DATA, math500=MATH500, store=store, part=args.part,
                      acc_start=args.acc_start, skip=filter(None, args.skip.split(",")), recalibrate=args.recalibrate,
                      budget_s=None if args.budget_min is None else 60 * args.budget_min, out=out if whole else None)
        out = out if whole else store.path(kvx.part_name(args.part, args.acc_start))
    print(f"results written to {out}")
    kvx.write_plot(res, out)
    print(json.dumps(res["figures"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
