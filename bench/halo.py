"""HALO vs full finetuning vs LISA vs step-wise unfreezing: SFT of the bundled model on GSM8K train.

Each schedule trains a fresh copy of SmolLM2-135M-Instruct with the same data
order, optimizer (AdamW, constant LR after a 1-step warmup) and step budget,
through the same ``HaloSFTTrainer`` the recipe uses. Figures per schedule:

- steps / train seconds to reach the target validation loss (completion NLL
  on GSM8K test questions, measured every ``eval_every`` steps). Target =
  initial loss minus ``--target_frac`` (0.8) of the improvement full
  finetuning achieves by the end of the budget, so the anchor (full
  finetuning) defines it in the same comparison.
- final validation loss.
- forgetting: completion NLL on MATH-500 solutions (never trained on) after
  training minus before (negative = that loss went down too).
- optimizer-state memory: AdamW state bytes averaged over steps and at peak.

Ratios against full finetuning: ``optimizer_bytes_ratio`` (mean HALO optimizer
state / mean full), ``steps_ratio_halo``, ``wall_ratio_halo``,
``train_s_ratio_halo``. Train seconds exclude the validation passes. Curves:
validation loss vs step and vs train seconds, PNGs next to the JSON.

    .venv/bin/python bench/halo.py --quick     # 6 steps, batch 2, 128 tokens: a smoke run (~5 min idle)
    .venv/bin/python bench/halo.py             # the full comparison (preset FULL below)

Why the full preset is what it is (timed on the shared 2-core CPU box, 1 torch
thread, load ~2.5): one full-finetuning step of SmolLM2-135M costs ~15 s at
batch 4 x <=256 tokens (~8 s at batch 2, ~34 s at batch 8, ~22 s at batch 4 x
384); a validation pass over 16 GSM8K test examples ~20 s. GSM8K chat examples
are ~220 tokens on average (90% <= 315), so 256 tokens keeps most answers whole.
30 steps is the smallest budget where the schedule really plays out: HALO's t
goes 0 -> 1 over the first half (15 steps; the 31 units -- head with the
tied embedding, then the 30 decoder layers -- ramp in one after another), the
second half is full finetuning for everyone but LISA, and validation every 3
steps gives 10 points per curve. Measured: ~6-7 min per schedule (280-360 s training, the rest
validation and loading), ~30 min for all four -- hence the per-method split below. The earlier default
(60 steps, batch 8, 384 tokens, 48 validation examples) was ~5x that compute
and did not fit the machine's shared time.

Runs can be split per schedule (each piece holds a CPU slot for ~7 min):

    .venv/bin/python bench/halo.py --methods full
    .venv/bin/python bench/halo.py --methods halo
    ...

Each piece saves its raw run to ``bench/results/halo_parts/<name>_<method>.json``;
after every piece, all parts with the same configuration are merged and the
figures/plots rewritten, so four pieces give the same JSON as one plain
``bench/halo.py`` (up to timing noise). The figures need the ``full`` part
(it defines the target). ``--fresh`` ignores saved parts; ``--merge_only``
trains nothing and just merges them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"
METHODS = ("full", "halo", "lisa", "stepwise")

QUICK = {"steps": 6, "batch": 2, "max_length": 128, "eval_every": 2, "n_train": 32, "n_val": 8, "n_forget": 8,
         "lr": 1e-4}
FULL = {"steps": 30, "batch": 4, "max_length": 256, "eval_every": 3, "n_train": 120, "n_val": 16, "n_forget": 16,
        "lr": 1e-4}
# keys that must match for two saved parts to be merged into one comparison
CONFIG_KEYS = (*FULL, "homotopy_fraction", "ramp_width", "lisa_layers", "lisa_interval")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps on short sequences (smoke run)")
    for k, v in FULL.items():
        p.add_argument(f"--{k}", type=type(v), help=f"override the preset (full: {v}, quick: {QUICK[k]})")
    p.add_argument("--target_frac", type=float, default=0.8,
                   help="target = initial val loss - frac * (full finetuning's improvement)")
    p.add_argument("--homotopy_fraction", type=float, default=0.5, help="HALO: share of the budget for t: 0->1")
    p.add_argument("--ramp_width", type=float, default=0.25, help="HALO: ramp width per unit (share of t)")
    p.add_argument("--lisa_layers", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="schedules to train in this invocation (others are taken from saved parts)")
    p.add_argument("--name", help="results name (default halo, or halo_quick with --quick)")
    p.add_argument("--fresh", action="store_true", help="do not merge parts saved by earlier invocations")
    p.add_argument("--merge_only", action="store_true", help="train nothing; merge the saved parts")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the shared box: 1)")
    return p.parse_args()


def train_methods(args, cfg: dict) -> dict[str, dict]:
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig

    from llmkit.models import load
    from llmkit.train.common import chat_dataset, completion_loss, load_records
    from llmkit.train.halo.trainer import trainer_class

    torch.manual_seed(0)
    base, tok = load("smollm2-135m-instruct")
    train_ds = chat_dataset(load_records(str(DATA / "gsm8k/train.jsonl"), limit=cfg["n_train"]))
    val = load_records(str(DATA / "gsm8k/test.jsonl"), limit=cfg["n_val"])
    forget = load_records(str(DATA / "math500/test.jsonl"), limit=cfg["n_forget"])
    L = cfg["max_length"]

    def val_loss(model):
        return completion_loss(model, tok, val, max_length=L, batch_size=cfg["batch"])

    init_val = val_loss(base)
    init_forget = completion_loss(base, tok, forget, max_length=L, batch_size=cfg["batch"])
    print(f"initial val loss {init_val:.4f}, initial forget-set loss {init_forget:.4f}", flush=True)

    class Probe(TrainerCallback):
        """Train-time clock (validation excluded) and validation loss every eval_every steps."""

        def __init__(self):
            self.train_s, self.curve = 0.0, [(0, 0.0, init_val)]
            self.losses: list[tuple[int, float]] = []

        def on_step_begin(self, a, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kw):
            self.train_s += time.perf_counter() - self._t0
            if state.global_step % cfg["eval_every"] == 0 or state.global_step == state.max_steps:
                self.curve.append((state.global_step, self.train_s, val_loss(model)))
                print(f"[{a.output_dir.rsplit('/', 1)[-1]}] step {state.global_step}: val loss "
                      f"{self.curve[-1][2]:.4f}, train s {self.train_s:.1f}", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, float(logs["loss"])))

    runs = {}
    out_root = Path(os.environ.get("TMPDIR", "/tmp")) / "llmkit-bench-halo"
    for method in args.methods:
        model = copy.deepcopy(base)
        model.train()
        probe = Probe()
        targs = SFTConfig(
            output_dir=str(out_root / method), max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
            learning_rate=cfg["lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=1, weight_decay=0.0,
            max_length=L, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
            data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = trainer_class(distill=False)(
            model=model, args=targs, train_dataset=train_ds, processing_class=tok, callbacks=[probe],
            halo_callback_kwargs={"method": method, "homotopy_fraction": args.homotopy_fraction,
                                      "ramp_width": args.ramp_width, "lisa_layers": args.lisa_layers,
                                      "lisa_interval": cfg["lisa_interval"], "seed": 0})
        print(f"[{method}] training {cfg['steps']} steps", flush=True)
        load_before = os.getloadavg()[0]
        wall0 = time.perf_counter()
        trainer.train()
        forget_after = completion_loss(model, tok, forget, max_length=L, batch_size=cfg["batch"])
        opt_bytes = trainer.halo.optimizer_bytes
        runs[method] = {
            "config": {k: cfg[k] for k in CONFIG_KEYS},
            "initial_val": init_val, "initial_forget": init_forget,
            "curve": probe.curve, "train_losses": probe.losses, "train_s": probe.train_s,
            "wall_s": time.perf_counter() - wall0,
            "load_1min": [load_before, os.getloadavg()[0]],
            "final_val": probe.curve[-1][2], "forgetting": forget_after - init_forget,
            "opt_bytes": opt_bytes,
            "opt_bytes_mean": sum(opt_bytes) / len(opt_bytes), "opt_bytes_peak": max(opt_bytes),
            "units": len(trainer.halo.controller.units),
        }
        print(f"[{method}] done: final val {probe.curve[-1][2]:.4f}, train s {probe.train_s:.1f}, "
              f"load {runs[method]['load_1min']}", flush=True)
        del trainer, model
    return runs


def figures_for(runs: dict[str, dict], target_frac: float) -> dict:
    full = runs.get("full")
    init_val = next(iter(runs.values()))["initial_val"]
    target = init_val - target_frac * (init_val - full["final_val"]) if full else None
    figures: dict[str, float | int | None] = {"target_val_loss": target, "initial_val_loss": init_val}
    for m in METHODS:
        if m not in runs:
            continue
        r = runs[m]
        hit = next(((s, t) for s, t, v in r["curve"][1:] if target is not None and v <= target), (None, None))
        r["steps_to_target"], r["wall_to_target_s"] = hit
        figures[f"steps_to_target_{m}"] = hit[0]
        figures[f"wall_to_target_s_{m}"] = hit[1]
        figures[f"final_val_loss_{m}"] = r["final_val"]
        figures[f"forgetting_{m}"] = r["forgetting"]
        figures[f"optimizer_mb_mean_{m}"] = r["opt_bytes_mean"] / 2**20
        figures[f"optimizer_mb_peak_{m}"] = r["opt_bytes_peak"] / 2**20
        figures[f"train_s_{m}"] = r["train_s"]
    if full and "halo" in runs:
        h = runs["halo"]
        figures["optimizer_bytes_ratio"] = h["opt_bytes_mean"] / full["opt_bytes_mean"]
        figures["optimizer_peak_bytes_ratio"] = h["opt_bytes_peak"] / full["opt_bytes_peak"]
        figures["train_s_ratio_halo"] = h["train_s"] / full["train_s"]
        if h["steps_to_target"] and full["steps_to_target"]:
            figures["steps_ratio_halo"] = h["steps_to_target"] / full["steps_to_target"]
            figures["wall_ratio_halo"] = h["wall_to_target_s"] / full["wall_to_target_s"]
    return figures


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    for k in FULL:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    cfg.update(homotopy_fraction=args.homotopy_fraction, ramp_width=args.ramp_width, lisa_layers=args.lisa_layers,
               lisa_interval=max(2, cfg["steps"] // 5))
    name = args.name or ("halo_quick" if args.quick else "halo")
    parts_dir = RESULTS / "halo_parts"
    parts_dir.mkdir(parents=True, exist_ok=True)

    new = {} if args.merge_only else train_methods(args, cfg)
    for m, r in new.items():
        (parts_dir / f"{name}_{m}.json").write_text(json.dumps(r, indent=1) + "\n")

    runs: dict[str, dict] = {}
    want = {k: cfg[k] for k in CONFIG_KEYS}
    for m in METHODS:
        if m in new:
            runs[m] = new[m]
        elif not args.fresh and (parts_dir / f"{name}_{m}.json").exists():
            r = json.loads((parts_dir / f"{name}_{m}.json").read_text())
            if r.get("config") == want:
                runs[m] = r
            else:
                print(f"[merge] ignoring saved {m} part: different configuration", flush=True)
    if len({round(r["initial_val"], 4) for r in runs.values()}) > 1:
        raise SystemExit("saved parts disagree on the initial validation loss; rerun with --fresh")
    if "full" not in runs:
        print("[merge] no full-finetuning run yet (it defines the target): run --methods full to get figures")
        return 0

    figures = figures_for(runs, args.target_frac)
    from llmkit.train.common import plot_curves

    out_json = RESULTS / f"{name}.json"
    report = {"config": {**cfg, "quick": args.quick, "target_frac": args.target_frac, "threads": args.threads,
                         "methods": [m for m in METHODS if m in runs], "model": "smollm2-135m-instruct",
                         "units": runs["full"]["units"]},
              "figures": figures, "runs": {m: {k: v for k, v in r.items() if k != "opt_bytes"} for m, r in runs.items()}}
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    target = figures["target_val_loss"]
    plot_curves({m: ([s for s, _, _ in r["curve"]], [v for _, _, v in r["curve"]]) for m, r in runs.items()},
                RESULTS / f"{name}.png", title="GSM8K validation loss (SmolLM2-135M SFT)", ylabel="val loss",
                hline=target)
    plot_curves({m: ([t for _, t, _ in r["curve"]], [v for _, _, v in r["curve"]]) for m, r in runs.items()},
                RESULTS / f"{name}_time.png", title="GSM8K validation loss vs train time",
                xlabel="train seconds", ylabel="val loss", hline=target)
    plot_curves({m: (list(range(1, len(r["opt_bytes"]) + 1)), [b / 2**20 for b in r["opt_bytes"]])
                 for m, r in runs.items() if r.get("opt_bytes")},
                RESULTS / f"{name}_optimizer_mb.png", title="AdamW state after each step", ylabel="MB")
    for k, v in figures.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {out_json} (curves: {RESULTS / (name + '.png')}, {RESULTS / (name + '_time.png')}, "
          f"{RESULTS / (name + '_optimizer_mb.png')})")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
