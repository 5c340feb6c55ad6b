"""LQZO bench: MeZO (full precision), QZO and LQZO at INT4 and INT2, and first-order QLoRA, on the bundled model.

    python bench/lqzo.py --quick      # 40 ZO steps per run, lr swept per method, 3 seeds at INT2; ends with one JSON line
    python bench/lqzo.py              # 200 steps, 3 seeds everywhere, more validation / test rows
    python bench/lqzo.py --long       # QZO vs LQZO at INT2 / INT4: 1000 steps at batch 1 on sentiment rows, 5 / 3 seeds

--long, on both cores (one process per bit-width, then the summary; rerun the same line to resume):

    export OMP_NUM_THREADS=1; (python bench/lqzo.py --long --only int2,qzo_int2,lqzo_int2,probes > /tmp/lqzo_long_a.log 2>&1 & python bench/lqzo.py --long --only fp,int4,qzo_int4,lqzo_int4 > /tmp/lqzo_long_b.log 2>&1; wait) && python bench/lqzo.py --long

A fair comparison at an equal budget: every ZO run gets the same number of forward passes (steps x 2)
on the same data (GSM8K train solutions interleaved with the procedural sentiment task, see
llmkit/train/lqzo/task.py for why that task). Each method (and bit-width) gets its OWN learning rate,
chosen from a small sweep (``--lr-sweep`` for the scale-training methods, ``--mezo-lr-sweep`` for MeZO
on raw weights, ``--qlora-lr-sweep`` for the first-order QLoRA reference, which trains for as many
steps as a ZO run makes forward passes) by the completion loss on validation problems (GSM8K *train* problems never trained
on); the chosen lr is then rerun for each of ``--seeds`` seeds, and only the test figures are reported:
completion loss on held-out GSM8K *test* solutions and two-choice accuracy on held-out sentiment
problems (``llmkit.experiments.lqzo.tuned_runs``). Also: peak memory of an LQZO step vs a forward of
the same batch vs a QLoRA step (fresh process per probe); LQZO step time vs two forwards.

Each run cell (mezo, qzo_int4, lqzo_int4, qzo_int2, lqzo_int2, qlora_nf4) is saved to
bench/results/lqzo[_quick]_parts/<cell>.json as soon as it finishes and reused by later invocations with
the same configuration (``--only`` trains a subset, e.g. in two processes; ``--fresh`` ignores saved
parts). Writes bench/results/lqzo.json (lqzo_quick.json for --quick) and a PNG. --long saves every training
run (cell, lr, seed) as its own part in bench/results/lqzo_long_parts/ and writes lqzo_long.json: the LQZO - QZO
test loss and accuracy paired by seed, the cost of a step, and a loud line when a chosen lr is at a sweep's edge
(``llmkit.experiments.lqzo_long``). The estimator-quality table (piece ``estimator``) is also written on its
own, to lqzo[_quick]_estimator.json, whether or not every cell is there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from llmkit.experiments.lqzo import CELLS, PIECES

ROOT = Path(__file__).resolve().parents[1]


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"learning rates must be positive, got {text!r}")
    return vals


def _cells(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CELLS + PIECES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown cell(s) {', '.join(bad)}; choose from {', '.join(CELLS + PIECES)}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--long", action="store_true", help="QZO vs LQZO at INT2 / INT4, 1000 steps (see above)")
    ap.add_argument("--steps", type=int, default=None, help="ZO steps per run (quick 40, full 200, long 1000)")
    ap.add_argument("--lr-sweep", type=_floats, default=None,
                    help="comma-separated LQZO step sizes (relative, on log-scales), swept per bit-width (quick "
                         "and full 6.25e-5,2.5e-4,1e-3,4e-3; long 1.5625e-5,6.25e-5,2.5e-4,1e-3); "
                         "given without --qzo-lr-sweep it is QZO's grid too")
    ap.add_argument("--qzo-lr-sweep", type=_floats, default=None,
                    help="comma-separated QZO step sizes (additive on the scales; default: --lr-sweep when given, "
                         "else 9.765625e-7 .. 1e-3 in steps of 4)")
    ap.add_argument("--mezo-lr-sweep", type=_floats, default=None,
                    help="comma-separated MeZO step sizes (raw weights; quick 5e-7 .. 5.12e-4 in steps of 4; full 3e-7,1e-6,3e-6)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds per cell at the chosen lr, all cells (default: full 3; quick 3 for the INT2 cells, "
                         "whose comparison is the paper's claim, 1 for INT4, MeZO (a MeZO step costs ~3x) and QLoRA; "
                         "long 5 at INT2, 3 at INT4)")
    ap.add_argument("--clip", type=float, default=None, help="clip each projected derivative to [-c, c] (all methods)")
    ap.add_argument("--qlora-lr-sweep", type=_floats, default=None,
                    help="comma-separated QLoRA (AdamW) learning rates, chosen on validation like the ZO cells' "
                         "(default 5e-5,2e-4,8e-4,3.2e-3)")
    ap.add_argument("--batch", type=int, default=None, help="training batch (quick 2, full 4, long 1)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--only", type=_cells, default=None,
                    help=f"run only these pieces now (comma-separated from {', '.join(CELLS + PIECES)}: fp/int4/int2 are "
                         "the untrained metrics, probes the memory/time probes); the rest must be saved parts, "
                         "else the summary is not written")
    ap.add_argument("--fresh", action="store_true", help="ignore saved parts")
    ap.add_argument("--extend", action="store_true",
                    help="for the cells in --only that have a saved part: run only the --lr-sweep values it lacks and "
                         "merge (the best lr over both sweeps is reported; it is tested only if it is a new one)")
    ap.add_argument("--skip-qlora", action="store_true", help="leave out the QLoRA training run (its memory probe stays)")
    ap.add_argument("--skip", type=_cells, default=[],
                    help="run cells to leave out of this result (recorded as skipped, their summary keys null)")
    ap.add_argument("--estimator-seeds", type=int, default=None,
                    help="draws of the directions per variant in the estimator-quality table (quick 6, full 16)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "llmkit-lqzo-bench"))
    args = ap.parse_args()
    if args.skip_qlora:
        args.skip = sorted(set(args.skip) | {"qlora_nf4"})
    import torch

    from llmkit.experiments import lqzo as L

    try:
        p = L.presets(args.quick, args.steps, args.lr_sweep, args.mezo_lr_sweep, args.seeds, args.batch, args.long,
                      args.qlora_lr_sweep, args.qzo_lr_sweep)
    except ValueError as e:
        ap.error(str(e))
    torch.manual_seed(0)
    stem = "lqzo_long" if args.long else "lqzo_quick" if args.quick else "lqzo"
    out_dir = ROOT / "bench" / "results"
    bench = L.LqzoBench(p, parts_dir=out_dir / f"{stem}_parts", data_dir=ROOT.parent / "shared" / "data" / "gsm8k",
                        cache=args.cache, clip=args.clip, max_length=args.max_length,
                        group_size=args.group_size, quick=args.quick, fresh=args.fresh,
                        estimator_seeds=args.estimator_seeds)
    res = bench.run(args.only, args.skip, args.extend)
    est = res.get("estimator_quality")
    if est is not None:  # the estimator table stands on its own: written whether or not every cell is there
        keep = ("config", "rows", "max_length", "seeds", "best", "per_bits")
        (out_dir / f"{stem}_estimator.json").write_text(json.dumps(
            {"summary": est["keys"], **{k: est[k] for k in keep if k in est}}, indent=2) + "\n")
        print(f"wrote {out_dir / f'{stem}_estimator.json'}", flush=True)
    missing = [c for c in CELLS if c not in res["runs"]]
    if missing:
        print(f"saved parts in {bench.store.root}; still missing: {', '.join(missing)} (summary not written)",
              flush=True)
        return 0
    if args.long:
        from llmkit.experiments.lqzo_long import summarize_long

        res["summary"] = summarize_long(res, bench.probes())
    else:
        res["summary"] = L.summarize(res, bench.probes())
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    L.plot(res, out_dir / f"{stem}.png")
    print(json.dumps(res["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
