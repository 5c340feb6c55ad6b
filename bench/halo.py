"""HALO vs full finetuning vs LISA vs step-wise unfreezing: SFT of the bundled model on GSM8K.

Each schedule trains fresh copies of SmolLM2-135M-Instruct through the recipe's
``HaloSFTTrainer`` (AdamW, constant LR, no warmup, no weight decay).
The workload, sweep and statistics live in ``llmkit.train.halo.experiment``:

1. learning-rate sweep per schedule and training size (seed 0), scored on a
   sweep split of GSM8K *train* rows outside the training pool; each schedule
   then runs at its own best rate for that size (``--sweep_sizes smallest``: the
   earlier protocol, one sweep at the smallest size used for every size);
2. for every training size (the low-resource regime) and seed: a seeded subset of
   the pool and data order; validation loss (completion NLL on GSM8K *test*) every
   ``eval_every`` steps; forgetting = completion NLL on MATH-500 solutions (never
   trained on) after training minus before;
3. per size: target = initial val loss - ``target_frac`` x full finetuning's mean
   improvement; per schedule mean and sample std over seeds of steps to target
   (runs that never reach it are censored and counted in ``reached_*``), final val
   loss, forgetting, train seconds, AdamW state.

Legacy keys (``final_val_loss_halo``, ``steps_ratio_halo``, ...) are the means at
the largest size; ``*_n<size>`` keys hold the other size, ``*_std`` the spreads.

    .venv/bin/python bench/halo.py --quick     # sizes 8/64, 3 seeds, 6 steps, val at steps 3/6, lrs 3e-5/1e-4/3e-4
    .venv/bin/python bench/halo.py             # sizes 8/32, 3 seeds, 20 steps, val every 5 steps, lrs 1e-5 to 3e-4

Both presets use batch 2 x 128 tokens (GSM8K prompts are ~90 tokens, so a
sequence trains and scores the first ~40 answer tokens) and 1 torch thread.

Cost, measured on the quiet shared box (2 cores, 1 thread): one full-finetuning
step of SmolLM2-135M at batch 2 x 128 tokens takes ~3.5 s (batch 4 x 256: ~13 s),
the completion loss over 16 examples at 128 tokens ~12.5 s (at 256: ~28 s), 16
MATH-500 solutions at 384 tokens ~46 s. The first-pass full preset (sizes 64/256,
48 steps of batch 4 x 256, 64 val rows every 6 steps, 4 lrs) is ~6 slot-hours;
the shared box gave this run ~80 slot-minutes, so the full preset is cut where
it matters least: shorter sequences and fewer steps, but 3 seeds, every schedule
at its own swept rate (4 rates, 16 sweep runs per size), a 24-row validation set scored every 5
steps (5 points per curve), forgetting on 16 MATH-500 solutions, and two sizes
that both repeat data within the 40-example budget (20 steps x 2): n=8 is 5
epochs, n=32 is 1.25 epochs. (At 20 steps, 64 and 256 rows would both be under
one epoch and behave the same, so they would not test the low-resource regime.)
About 160 s per run + 80 s per sweep run, ~85 slot-minutes in all with the sweep
at the smallest size (the per-size sweep adds 16 sweep runs per further size);
split it over two processes with ``--methods full halo`` and ``--methods lisa stepwise``.

With ``--sweep_sizes smallest`` a schedule's rate can be too low for the larger
size; the per-size sweep (default) removes that. Control from the earlier
protocol (full finetuning at HALO's rate, n=32 only; its figures are comparable
with halo.json's n=32 keys, same data):

    .venv/bin/python bench/halo.py --name halo_full_lr3e-5_n32 --methods full --lrs 3e-5 --sizes 32

HALO's homotopy takes the first half of the budget (10 steps here) over 32 units
(the head with the tied matrix, 30 decoder layers, the tied matrix's input role);
LISA resamples its 2 layers every 4 steps. The quick preset (6 steps, val at 3
and 6) tests the machinery and the direction of effects only.

Every run is saved to ``bench/results/halo_parts/<name>/<run>.json`` as it finishes;
a rerun with the same configuration skips finished runs (``--fresh`` retrains all),
so the comparison can be built in several invocations (``--methods``, or after an
interruption). ``--merge_only`` trains nothing and writes the figures from the parts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"
METHODS = ("full", "halo", "lisa", "stepwise")

QUICK = {"steps": 6, "batch": 2, "max_length": 128, "eval_every": 3, "sizes": "8,64", "seeds": 3, "n_val": 24,
         "n_forget": 16, "n_sweep": 16, "lrs": "3e-5,1e-4,3e-4", "pool": 1000, "forget_max_length": 192}
FULL = {"steps": 20, "batch": 2, "max_length": 128, "eval_every": 5, "sizes": "8,32", "seeds": 3, "n_val": 24,
        "n_forget": 16, "n_sweep": 16, "lrs": "1e-5,3e-5,1e-4,3e-4", "pool": 1000, "forget_max_length": 192}
SWEEP_ROWS_FROM = 7000  # GSM8K train rows from here on form the sweep split (the pool is the first `pool` rows)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs at sizes 8/64 (see the docstring)")
    for k, v in FULL.items():
        p.add_argument(f"--{k}", type=type(v), help=f"override the preset (full: {v}, quick: {QUICK[k]})")
    p.add_argument("--target_frac", type=float, default=0.8,
                   help="target = initial val loss - frac * (full finetuning's mean improvement)")
    p.add_argument("--homotopy_fraction", type=float, default=0.5, help="HALO: share of the budget for t: 0->1")
    p.add_argument("--ramp_width", type=float, default=0.25, help="HALO: ramp width per unit (share of t)")
    p.add_argument("--lisa_layers", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
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

    from llmkit.train.common import completion_loss, load_records
    from llmkit.train.halo import experiment as ex

    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    for k in FULL:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    sizes = sorted(int(x) for x in _floats(cfg["sizes"], "sizes"))
    lrs = _floats(cfg["lrs"], "lrs")
    seeds = list(range(cfg["seeds"]))
    if not sizes or not lrs or not seeds:
        raise SystemExit("need at least one size, one learning rate and one seed")
    name = args.name or ("halo_quick" if args.quick else "halo")
    parts = RESULTS / "halo_parts" / name
    parts.mkdir(parents=True, exist_ok=True)
    common = {"steps": cfg["steps"], "batch": cfg["batch"], "max_length": cfg["max_length"],
              "eval_every": cfg["eval_every"], "homotopy_fraction": args.homotopy_fraction,
              "ramp_width": args.ramp_width, "lisa_layers": args.lisa_layers,
              "lisa_interval": max(2, cfg["steps"] // 5)}
    data_cfg = {k: cfg[k] for k in ("n_val", "n_forget", "n_sweep", "pool", "forget_max_length")}

    def part(kind, spec):
        return parts / f"{kind}_{spec.key()}.json"

    def saved(kind, spec):
        f = part(kind, spec)
        if args.fresh or not f.exists():
            return None
        r = json.loads(f.read_text())
        return r if r.get("spec") == spec.as_dict() and r.get("data") == data_cfg else None

    state = {}

    def model_and_data():  # loaded only when something has to be trained
        if not state:
            from llmkit.models import load

            base, tok = load("smollm2-135m-instruct")
            state.update(base=base, tok=tok,
                         pool=load_records(str(DATA / "gsm8k/train.jsonl"), limit=cfg["pool"]),
                         sweep=load_records(str(DATA / "gsm8k/train.jsonl"),
                                            limit=SWEEP_ROWS_FROM + cfg["n_sweep"])[SWEEP_ROWS_FROM:],
                         val=load_records(str(DATA / "gsm8k/test.jsonl"), limit=cfg["n_val"]),
                         forget=load_records(str(DATA / "math500/test.jsonl"), limit=cfg["n_forget"]))
            state["init_forget"] = completion_loss(base, tok, state["forget"], max_length=cfg["forget_max_length"],
                                                   batch_size=8)
            state["init_val"] = completion_loss(base, tok, state["val"], max_length=cfg["max_length"], batch_size=8)
            print(f"initial val loss {state['init_val']:.4f}, forget-set loss {state['init_forget']:.4f}", flush=True)
        return state

    def run(kind, spec, with_val):
        r = saved(kind, spec)
        if r is not None:
            return r
        if args.merge_only or spec.method not in args.methods:
            return None
        s = model_and_data()
        print(f"[{kind}] {spec.key()} ...", flush=True)
        r = ex.train_run(s["base"], s["tok"], ex.train_subset(s["pool"], spec.n_train, spec.seed), spec,
                         val_rows=s["val"] if with_val else None, initial_val=s["init_val"],
                         end_sets={"forget": s["forget"]} if with_val else {"sweep": s["sweep"]},
                         end_max_length=cfg["forget_max_length"] if with_val else None,
                         out_dir=Path(os.environ.get("TMPDIR", "/tmp")) / "llmkit-bench-halo",
                         log=lambda m: print(m, flush=True))
        r["data"] = data_cfg
        if with_val:
            r["initial_val"] = r["curve"][0][2]
            r["forgetting"] = r["end_losses"]["forget"] - s["init_forget"]
        part(kind, spec).write_text(json.dumps(r, indent=1) + "\n")
        print(f"[{kind}] {spec.key()} done: {r['end_losses']}, train s {r['train_s']:.1f}", flush=True)
        return r

    # 1. learning-rate sweep: seed 0, per size (or the smallest only), scored on the sweep split
    sweep_sizes = sizes if args.sweep_sizes == "each" else sizes[:1]
    sweep = {m: {} for m in METHODS}  # sweep[method][size][lr] = sweep loss
    for n in sweep_sizes:
        for m in METHODS:
            scores = {}
            for lr in lrs:
                r = run("sweep", ex.RunSpec(method=m, lr=lr, seed=0, n_train=n, **common), with_val=False)
                scores[lr] = r["end_losses"]["sweep"] if r else None
            sweep[m][n] = scores
            if any(v is not None for v in scores.values()):
                print(f"sweep {m} n={n}: " + ", ".join(f"lr {lr:g}: {v:.4f}" if v is not None else
                                                      f"lr {lr:g}: (not run)" for lr, v in scores.items())
                      + f" -> {ex.pick_best_lr(scores):g}", flush=True)
    best_lr = ex.rates_per_size(sweep, sizes, per_size=args.sweep_sizes == "each")  # (method, size) -> rate
    sweep_json = {m: {str(n): {f"{lr:g}": v for lr, v in sc.items()} for n, sc in per_n.items()}
                  for m, per_n in sweep.items()}
    if args.sweep_only:
        print(json.dumps(sweep_json))
        return 0
    # 2. every schedule at its own rate, seed-major so that an interrupted run still covers both sizes
    runs = []
    for seed in seeds:
        for n in sizes:
            for m in METHODS:
                if (m, n) in best_lr:
                    r = run("run", ex.RunSpec(method=m, lr=best_lr[m, n], seed=seed, n_train=n, **common),
                            with_val=True)
                    if r is not None:
                        runs.append(r)
    if not any(r["spec"]["method"] == "full" for r in runs):
        print("no full-finetuning run yet (it defines the target): run --methods full to get figures")
        return 0

    # 3. statistics, JSON, plot
    summary = ex.summarize_runs(runs, args.target_frac)
    figures = ex.flat_figures(summary, primary_n=max(summary))
    figures["seeds"] = len({r["spec"]["seed"] for r in runs})
    figures["sizes"] = sorted(summary)
    out_json = RESULTS / f"{name}.json"
    report = {"config": {**cfg, **common, "quick": args.quick, "target_frac": args.target_frac,
                         "threads": args.threads, "seeds": seeds, "sizes": sizes, "lrs": lrs,
                         "sweep_sizes": sweep_sizes,
                         "model": "smollm2-135m-instruct", "units": runs[0]["units"],
                         "data": {"pool": f"gsm8k/train.jsonl rows 0-{cfg['pool'] - 1}",
                                  "sweep": f"gsm8k/train.jsonl rows {SWEEP_ROWS_FROM}-"
                                           f"{SWEEP_ROWS_FROM + cfg['n_sweep'] - 1}",
                                  "val": f"gsm8k/test.jsonl first {cfg['n_val']}",
                                  "forget": f"math500/test.jsonl first {cfg['n_forget']}"}},
              "figures": figures, "sweep": sweep_json,
              "summary": {str(n): s for n, s in summary.items()},
              "runs": [{k: v for k, v in r.items() if k != "train_losses"} for r in runs]}
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    png = ex.plot_summary(runs, summary, RESULTS / f"{name}.png", title="GSM8K val loss, SmolLM2-135M SFT")
    for k, v in figures.items():
        print(f"{k}: {v:g}" if k.startswith("lr_") else f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {out_json} (curves: {png})")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
