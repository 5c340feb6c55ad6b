"""HALO vs full finetuning vs LISA vs step-wise unfreezing: SFT of the bundled model on GSM8K train.

Each schedule trains a fresh copy of SmolLM2-135M-Instruct with the same data
order, optimizer (AdamW, constant LR after a short warmup) and step budget,
through the same ``HaloSFTTrainer`` the recipe uses. Figures per schedule:

- steps / train seconds to reach the target validation loss (completion NLL
  on GSM8K test questions). Target = initial loss minus ``--target_frac`` (0.8)
  of the improvement full finetuning achieves by the end of the budget, so
  the anchor (full finetuning) defines it in the same run.
- final validation loss.
- forgetting: completion NLL on MATH-500 solutions (never trained on) after
  training minus before.
- optimizer-state memory: AdamW state bytes averaged over steps and at peak.

Ratios against full finetuning: ``optimizer_bytes_ratio`` (mean HALO optimizer
state / mean full), ``steps_ratio_halo``, ``wall_ratio_halo``.
Train seconds exclude the validation passes. Curves: validation loss vs step
and vs train seconds, PNGs next to the JSON.

    .venv/bin/python bench/halo.py --quick     # ~2-3 min on an idle 2-core CPU: 6 steps, 128 tokens
    .venv/bin/python bench/halo.py             # 60 steps, longer sequences (tens of minutes on CPU)
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
FULL = {"steps": 60, "batch": 8, "max_length": 384, "eval_every": 5, "n_train": 1024, "n_val": 48, "n_forget": 48, "lr": 1e-4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps on short sequences (~2-3 min)")
    p.add_argument("--steps", type=int, help="optimizer steps per schedule (overrides the preset)")
    p.add_argument("--target_frac", type=float, default=0.8,
                   help="target = initial val loss - frac * (full finetuning's improvement)")
    p.add_argument("--homotopy_fraction", type=float, default=0.5, help="HALO: share of the budget for t: 0->1")
    p.add_argument("--ramp_width", type=float, default=0.25, help="HALO: ramp width per unit (share of t)")
    p.add_argument("--lisa_layers", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig

    from llmkit.models import load
    from llmkit.train.common import chat_dataset, completion_loss, load_records, plot_curves
    from llmkit.train.halo.trainer import trainer_class

    cfg = dict(QUICK if args.quick else FULL)
    if args.steps:
        cfg["steps"] = args.steps
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
            data_seed=0, dataloader_num_workers=0, disable_tqdm=False,
        )
        trainer = trainer_class(distill=False)(
            model=model, args=targs, train_dataset=train_ds, processing_class=tok, callbacks=[probe],
            halo_callback_kwargs={"method": method, "homotopy_fraction": args.homotopy_fraction,
                                      "ramp_width": args.ramp_width, "lisa_layers": args.lisa_layers,
                                      "lisa_interval": max(2, cfg["steps"] // 5), "seed": 0})
        print(f"[{method}] training {cfg['steps']} steps", flush=True)
        trainer.train()
        forget_after = completion_loss(model, tok, forget, max_length=L, batch_size=cfg["batch"])
        opt_bytes = trainer.halo.optimizer_bytes
        runs[method] = {
            "curve": probe.curve, "train_losses": probe.losses, "train_s": probe.train_s,
            "final_val": probe.curve[-1][2], "forgetting": forget_after - init_forget,
            "opt_bytes_mean": sum(opt_bytes) / len(opt_bytes), "opt_bytes_peak": max(opt_bytes),
            "units": len(trainer.halo.controller.units),
        }
        del trainer, model

    full = runs.get("full")
    target = init_val - args.target_frac * (init_val - full["final_val"]) if full else None
    figures: dict[str, float | int | None] = {"target_val_loss": target, "initial_val_loss": init_val}
    for m, r in runs.items():
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

    name = "halo_quick" if args.quick else "halo"
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json = RESULTS / f"{name}.json"
    report = {"config": {**cfg, **{k: v for k, v in vars(args).items() if k != "quick"}, "quick": args.quick,
                         "model": "smollm2-135m-instruct", "units": runs[next(iter(runs))]["units"]},
              "figures": figures, "runs": runs}
    out_json.write_text(json.dumps(report, indent=2) + "\n")
    plot_curves({m: ([s for s, _, _ in r["curve"]], [v for _, _, v in r["curve"]]) for m, r in runs.items()},
                RESULTS / f"{name}.png", title="GSM8K validation loss (SmolLM2-135M SFT)", ylabel="val loss",
                hline=target)
    plot_curves({m: ([t for _, t, _ in r["curve"]], [v for _, _, v in r["curve"]]) for m, r in runs.items()},
                RESULTS / f"{name}_time.png", title="GSM8K validation loss vs train time",
                xlabel="train seconds", ylabel="val loss", hline=target)
    for k, v in figures.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {out_json} (curves: {RESULTS / (name + '.png')}, {RESULTS / (name + '_time.png')})")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
