"""HALO vs full finetuning vs LISA vs step-wise unfreezing: SFT of the bundled model on GSM8K.

Each schedule trains fresh copies of SmolLM2-135M-Instruct through the recipe's ``HaloSFTTrainer`` (AdamW,
constant LR, no warmup, no weight decay). The protocol (per-size learning-rate sweep on a split outside the
training pool, seeded subsets, censored steps to target, forgetting on MATH-500) is in
``llmkit.experiments.halo``; the figures are on bench/results/halo.md.

    .venv/bin/python bench/halo.py --quick     # sizes 8/64, 3 seeds, 6 steps, val at steps 3/6, lrs 3e-5/1e-4/3e-4
    .venv/bin/python bench/halo.py             # sizes 8/32, 3 seeds, 20 steps, val every 5 steps, lrs 3e-6 to 1e-3

Both presets use batch 2 x 128 tokens (GSM8K prompts are ~90 tokens, so a sequence trains and scores the first
~40 answer tokens) and 1 torch thread. The full preset's sizes both repeat data within its 40-example budget
(20 steps x 2): n=8 is 5 epochs, n=32 is 1.25 epochs (at 20 steps, 64 and 256 rows would both be under one epoch
and behave the same). Every run, sweep runs included, trains for the full step budget on one thread, which takes
long on a 2-core box: split a comparison over two processes with ``--methods full halo`` and
``--methods lisa stepwise``, and rerun the same command after an interruption.

Legacy keys (``final_val_loss_halo``, ``steps_ratio_halo``, ...) are the means at the largest size;
``*_n<size>`` keys hold the other size, ``*_std`` the spreads. With ``--sweep_sizes smallest`` (the earlier
protocol, that of the committed halo.json) one sweep at the smallest size sets every size's rate, which can be
too low for the larger size. Control (full finetuning at HALO's rate, n=32 only; comparable with halo.json's
n=32 keys, same data):

    .venv/bin/python bench/halo.py --name halo_full_lr3e-5_n32 --methods full --lrs 3e-5 --sizes 32

Every run is saved to ``bench/results/halo_parts/<name>/<run>.json`` as it finishes; a rerun with the same
configuration skips finished runs (``--fresh`` retrains all), so the comparison can be built in several
invocations (``--methods``, or after an interruption). ``--merge_only`` trains nothing and writes the figures
from the parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"


def parse_args():
    from llmkit.experiments.halo import FULL, QUICK, SCHEDULES
    from llmkit.experiments.harness import preset_parser

    p = preset_parser(__doc__, FULL, QUICK, "short runs at sizes 8/64 (see the docstring)")
    p.add_argument("--target_frac", type=float, default=0.8,
                   help="target = initial val loss - frac * (full finetuning's mean improvement)")
    p.add_argument("--homotopy_fraction", type=float, default=0.5, help="HALO: share of the budget for t: 0->1")
    p.add_argument("--ramp_width", type=float, default=0.25, help="HALO: ramp width per unit (share of t)")
    p.add_argument("--lisa_layers", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   help="schedules to train in this invocation (others come from saved parts)")
    p.add_argument("--name", help="results name (default halo, or halo_quick with --quick)")
    p.add_argument("--fresh", action="store_true", help="retrain runs that have saved parts")
    p.add_argument("--merge_only", action="store_true", help="train nothing; figures from the saved parts")
    p.add_argument("--sweep_sizes", choices=("each", "smallest"), default="each",
                   help="sweep the learning rate at every training size (each) or at the smallest only")
    p.add_argument("--sweep_only", action="store_true",
                   help="run (or read) the learning-rate sweep, print its scores and stop")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the shared box: 1)")
    return p.parse_args()


def _floats(s: str, what: str) -> list:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what} must be comma-separated numbers, got {s!r}") from None


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from llmkit.experiments import halo as ex
    from llmkit.experiments.harness import ResultStore

    torch.set_num_threads(args.threads)
    cfg = ex.resolve_config(args.quick, {k: getattr(args, k) for k in ex.FULL})
    sizes = sorted(int(x) for x in _floats(cfg["sizes"], "sizes"))
    lrs = _floats(cfg["lrs"], "lrs")
    seeds = list(range(cfg["seeds"]))
    if not sizes or not lrs or not seeds:
        raise SystemExit("need at least one size, one learning rate and one seed")
    name = args.name or ("halo_quick" if args.quick else "halo")
    common = ex.run_settings(cfg, args.homotopy_fraction, args.ramp_width, args.lisa_layers)
    store = ResultStore(RESULTS / "halo_parts" / name, {k: cfg[k] for k in ex.DATA_KEYS}, fresh=args.fresh)
    log = lambda m: print(m, flush=True)
    runs = ex.Runs(store, lambda: ex.load_workload(DATA, cfg, log=log), train=() if args.merge_only else args.methods,
                   out_dir=Path(os.environ.get("TMPDIR", "/tmp")) / "llmkit-bench-halo", log=log)

    # 1. learning-rate sweep: seed 0, per size (or the smallest only), scored on the sweep split
    sweep_sizes = sizes if args.sweep_sizes == "each" else sizes[:1]
    sweep = ex.sweep_rates(runs, sweep_sizes, lrs, common, log=log)
    if args.sweep_only:
        print(json.dumps(ex.sweep_json(sweep)))
        return 0
    # 2. every schedule at its own rate for the size
    rates = ex.rates_per_size(sweep, sizes, per_size=args.sweep_sizes == "each")
    done = ex.comparison_runs(runs, rates, seeds, sizes, common)
    if not any(r["spec"]["method"] == "full" for r in done):
        print("no full-finetuning run yet (it defines the target): run --methods full to get figures")
        return 0
    # 3. statistics, JSON, plot
    settings = {**cfg, **common, "quick": args.quick, "target_frac": args.target_frac, "threads": args.threads,
                "seeds": seeds, "sizes": sizes, "lrs": lrs, "sweep_sizes": sweep_sizes}
    report, summary = ex.build_report(done, sweep, settings, args.target_frac)
    out_json = RESULTS / f"{name}.json"
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    png = ex.plot_summary(done, summary, RESULTS / f"{name}.png", title="GSM8K val loss, SmolLM2-135M SFT")
    print("\n".join(ex.figure_lines(report["figures"])))
    print(f"results: {out_json} (curves: {png})")
    print(json.dumps(report["figures"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
