"""The HALO comparison as a library: one training run, the learning-rate sweep, seeds, sizes, statistics.

``bench/halo.py`` is a thin driver over this module. A comparison is:

  1. For each schedule (full, stepwise, LISA, HALO) and training size, a learning-rate
     sweep: one run per candidate rate at seed 0 on that size, scored by
     the completion loss on a *sweep split* (rows held out of the training pool
     and disjoint from the reported validation set, so picking the rate does not
     peek at the numbers we report). ``pick_best_lr`` takes the lowest loss.
  2. Every schedule at its own best rate for the size, for each training size and seed: a
     seeded subset of the training pool (``train_subset``: the first n rows of a
     seed's permutation, so the small set is inside the large one), a seeded data
     order, validation loss every ``eval_every`` steps, and forgetting = loss on
     a set the run never trains on (after minus before).
  3. ``summarize_runs``: per size, target = initial validation loss minus
     ``target_frac`` of full finetuning's mean improvement; per schedule the mean
     and spread (sample std over seeds) of final validation loss, forgetting,
     train seconds and optimizer state, and steps to target with the runs that
     never reach it counted as censored (``reached`` = how many did), never as
     the step budget.

``train_run`` trains one copy of a model with ``HaloSFTTrainer`` (AdamW, constant rate, no
warmup: a 1-step warmup starts at rate 0 and wastes a sixth of a 6-step run), the trainer the
recipe uses, so the bench measures the shipped code path.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from llmkit.train.halo.schedule import METHODS


@dataclass(frozen=True)
class RunSpec:
    """One training run: a schedule at a learning rate on a seeded subset of the training pool."""

    method: str
    lr: float
    seed: int
    n_train: int
    steps: int
    batch: int = 2
    max_length: int = 128
    eval_every: int = 2
    homotopy_fraction: float = 0.5
    ramp_width: float = 0.25
    lisa_layers: int = 2
    lisa_interval: int = 2

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown schedule {self.method!r}; choose one of {', '.join(METHODS)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"learning rate must be a positive number, got {self.lr!r}")
        for k in ("n_train", "steps", "batch", "max_length", "eval_every", "lisa_interval"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")

    def key(self) -> str:
        return f"{self.method}_n{self.n_train}_s{self.seed}_lr{self.lr:g}"

    def as_dict(self) -> dict:
        return asdict(self)


def train_subset(pool: Sequence[dict], n: int, seed: int) -> list[dict]:
    """The first ``n`` rows of a seed-dependent permutation of ``pool`` (nested across n for one seed)."""
    if n > len(pool):
        raise ValueError(f"asked for {n} training rows but the pool has {len(pool)}")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [pool[i] for i in order[:n]]


def pick_best_lr(losses: dict[float, float]) -> float:
    """The learning rate with the lowest (finite) sweep loss; ties go to the smaller rate."""
    finite = {lr: v for lr, v in losses.items() if v is not None and math.isfinite(v)}
    if not finite:
        raise ValueError(f"no learning rate gave a finite sweep loss: {losses}")
    return min(sorted(finite), key=lambda lr: finite[lr])


def rates_per_size(sweep: dict[str, dict[int, dict[float, float | None]]], sizes: Sequence[int],
                   per_size: bool = True) -> dict[tuple[str, int], float]:
    """``(schedule, size) -> rate`` from ``sweep[schedule][size][rate] = sweep loss``.

    ``per_size``: each size takes the rate picked on its own sweep, and a size without a finished sweep run is
    left out (no rate picked at another size stands in for it). Otherwise (the one-sweep protocol) every size
    takes the rate picked at the smallest swept size."""
    out: dict[tuple[str, int], float] = {}
    for m, by_size in sweep.items():
        done = {n: sc for n, sc in by_size.items() if any(v is not None for v in sc.values())}
        if not done:
            continue
        for n in sizes:
            if per_size and n in done:
                out[m, n] = pick_best_lr(done[n])
            elif not per_size:
                out[m, n] = pick_best_lr(done[min(done)])
    return out


def lr_sweep(score: Callable[[float], float], lrs: Iterable[float]) -> tuple[float, dict[float, float]]:
    """Score each rate (lower is better; NaN/inf for diverged runs) and return (best rate, all scores)."""
    lrs = list(lrs)
    if not lrs:
        raise ValueError("the learning-rate sweep needs at least one rate")
    losses = {lr: score(lr) for lr in lrs}
    return pick_best_lr(losses), losses


def steps_to_target(curve: Sequence[Sequence[float]], target: float | None) -> tuple[int | None, float | None]:
    """First (step, train seconds) of a (step, seconds, loss) curve at or below ``target``; (None, None) if never."""
    if target is None:
        return None, None
    for step, secs, loss in curve[1:]:
        if loss <= target:
            return int(step), float(secs)
    return None, None


def spread(values: Sequence[float | None]) -> dict:
    """Mean, sample std (0 for one value), min, max and count of the non-missing values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_runs(runs: Sequence[dict], target_frac: float = 0.8) -> dict:
    """Per training size and schedule: the statistics over seeds (see the module docstring).

    Each run is a dict from ``train_run`` plus ``spec`` (``RunSpec.as_dict()``), ``initial_val``
    and ``forgetting``. Raises if a size has no full-finetuning run (it defines the target).
    """
    if not 0 < target_frac <= 1:
        raise ValueError(f"target_frac must be in (0, 1], got {target_frac}")
    out: dict[int, dict] = {}
    for n in sorted({r["spec"]["n_train"] for r in runs}):
        at_n = [r for r in runs if r["spec"]["n_train"] == n]
        full = [r for r in at_n if r["spec"]["method"] == "full"]
        if not full:
            raise ValueError(f"no full-finetuning run at n_train={n}: it defines the target")
        init = statistics.fmean(r["initial_val"] for r in at_n)
        full_final = statistics.fmean(r["curve"][-1][2] for r in full)
        target = init - target_frac * (init - full_final)
        per_method = {}
        for m in METHODS:
            rs = sorted((r for r in at_n if r["spec"]["method"] == m), key=lambda r: r["spec"]["seed"])
            if not rs:
                continue
            hits = [steps_to_target(r["curve"], target) for r in rs]
            per_method[m] = {
                "lr": rs[0]["spec"]["lr"],
                "seeds": [r["spec"]["seed"] for r in rs],
                "final_val_loss": spread([r["curve"][-1][2] for r in rs]),
                "best_val_loss": spread([min(v for _, _, v in r["curve"]) for r in rs]),
                "forgetting": spread([r["forgetting"] for r in rs]),
                "steps_to_target": spread([s for s, _ in hits]),
                "train_s_to_target": spread([t for _, t in hits]),
                "reached": sum(s is not None for s, _ in hits),
                "steps_to_target_per_seed": [s for s, _ in hits],
                "train_s": spread([r["train_s"] for r in rs]),
                "optimizer_mb_mean": spread([r["opt_bytes_mean"] / 2**20 for r in rs]),
                "optimizer_mb_peak": spread([r["opt_bytes_peak"] / 2**20 for r in rs]),
            }
        out[n] = {"initial_val_loss": init, "target_val_loss": target, "methods": per_method}
    return out


def flat_figures(summary: dict, primary_n: int) -> dict:
    """One flat dict of figures: the legacy keys (means at ``primary_n``), their spreads, and per-size keys."""
    figs: dict = {}
    for n, s in summary.items():
        suffix = "" if n == primary_n else f"_n{n}"
        figs[f"target_val_loss{suffix}"] = s["target_val_loss"]
        figs[f"initial_val_loss{suffix}"] = s["initial_val_loss"]
        for m, r in s["methods"].items():
            figs[f"lr_{m}{suffix}"] = r["lr"]  # each size's own swept rate
            for key, name in (("steps_to_target", "steps_to_target"), ("train_s_to_target", "wall_to_target_s"),
                              ("final_val_loss", "final_val_loss"), ("forgetting", "forgetting"),
                              ("optimizer_mb_mean", "optimizer_mb_mean"), ("optimizer_mb_peak", "optimizer_mb_peak"),
                              ("train_s", "train_s")):
                figs[f"{name}_{m}{suffix}"] = r[key]["mean"]
                if key in ("steps_to_target", "final_val_loss", "forgetting", "train_s_to_target"):
                    figs[f"{name}_{m}{suffix}_std"] = r[key]["std"]
            figs[f"reached_{m}{suffix}"] = r["reached"]
        ms = s["methods"]
        if "full" in ms and "halo" in ms:
            f, h = ms["full"], ms["halo"]
            figs[f"optimizer_bytes_ratio{suffix}"] = _ratio(h["optimizer_mb_mean"]["mean"], f["optimizer_mb_mean"]["mean"])
            figs[f"optimizer_peak_bytes_ratio{suffix}"] = _ratio(h["optimizer_mb_peak"]["mean"],
                                                                 f["optimizer_mb_peak"]["mean"])
            figs[f"train_s_ratio_halo{suffix}"] = _ratio(h["train_s"]["mean"], f["train_s"]["mean"])
            figs[f"steps_ratio_halo{suffix}"] = _ratio(h["steps_to_target"]["mean"], f["steps_to_target"]["mean"])
            figs[f"wall_ratio_halo{suffix}"] = _ratio(h["train_s_to_target"]["mean"], f["train_s_to_target"]["mean"])
            figs[f"final_val_ratio_halo{suffix}"] = _ratio(h["final_val_loss"]["mean"], f["final_val_loss"]["mean"])
    return figs


def _ratio(a, b):
    return a / b if a is not None and b else None


def train_run(base_model, tok, train_rows: list[dict], spec: RunSpec, *, val_rows: list[dict] | None = None,
              initial_val: float | None = None, end_sets: dict[str, list[dict]] | None = None,
              end_max_length: int | None = None,
              eval_batch: int = 8, out_dir: str | Path = "/tmp", log: Callable[[str], None] = print) -> dict:
    """Train a deep copy of ``base_model`` with ``spec``; return its validation curve and end-of-run losses.

    ``curve``: (step, train seconds, validation loss) at step 0 (when ``val_rows``) and every
    ``eval_every`` steps and at the end; train seconds exclude evaluation. ``initial_val``: the base
    model's validation loss if the caller has it (every run starts from the same weights). ``end_losses``: completion
    loss on each of ``end_sets`` after training (forgetting sets, the sweep split), with sequences
    cut at ``end_max_length`` (default ``spec.max_length``; MATH-500 problems alone can fill 128 tokens).
    """
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig

    from llmkit.train.common import chat_dataset, completion_loss
    from llmkit.train.halo.trainer import trainer_class

    L = spec.max_length

    def loss_on(model, rows, max_length=L):
        return completion_loss(model, tok, rows, max_length=max_length, batch_size=eval_batch)

    torch.manual_seed(spec.seed)
    model = copy.deepcopy(base_model)
    model.train()
    curve: list[tuple[int, float, float]] = []
    tag = spec.key()

    class Probe(TrainerCallback):
        def __init__(self):
            self.train_s = 0.0
            self.losses: list[tuple[int, float]] = []

        def on_step_begin(self, a, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, a, state, control, model=None, **kw):
            self.train_s += time.perf_counter() - self._t0
            if val_rows and (state.global_step % spec.eval_every == 0 or state.global_step == state.max_steps):
                curve.append((state.global_step, self.train_s, loss_on(model, val_rows)))
                log(f"[{tag}] step {state.global_step}: val loss {curve[-1][2]:.4f}, train s {self.train_s:.1f}")

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, float(logs["loss"])))

    if val_rows:
        curve.append((0, 0.0, loss_on(model, val_rows) if initial_val is None else float(initial_val)))
    probe = Probe()
    targs = SFTConfig(
        output_dir=str(Path(out_dir) / tag), max_steps=spec.steps, per_device_train_batch_size=spec.batch,
        learning_rate=spec.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_length=L, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=spec.seed,
        data_seed=spec.seed, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = trainer_class(distill=False)(
        model=model, args=targs, train_dataset=chat_dataset(train_rows), processing_class=tok, callbacks=[probe],
        halo_callback_kwargs={"method": spec.method, "homotopy_fraction": spec.homotopy_fraction,
                              "ramp_width": spec.ramp_width, "lisa_layers": spec.lisa_layers,
                              "lisa_interval": spec.lisa_interval, "seed": spec.seed})
    wall0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - wall0
    end_losses = {name: loss_on(model, rows, end_max_length or L) for name, rows in (end_sets or {}).items()}
    opt_bytes = trainer.halo.optimizer_bytes or [0]
    result = {
        "spec": spec.as_dict(), "curve": curve, "train_losses": probe.losses, "train_s": probe.train_s,
        "wall_s": wall, "end_losses": end_losses, "opt_bytes_mean": sum(opt_bytes) / len(opt_bytes),
        "opt_bytes_peak": max(opt_bytes), "units": len(trainer.halo.controller.units),
    }
    del trainer, model
    return result


def plot_summary(runs: Sequence[dict], summary: dict, path: str | Path, title: str = "") -> Path:
    """Validation loss vs step, mean over seeds with a min-max band, one panel per training size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(summary)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.2 * len(sizes), 4.2), squeeze=False)
    for ax, n in zip(axes[0], sizes):
        for m in summary[n]["methods"]:
            curves = [r["curve"] for r in runs if r["spec"]["n_train"] == n and r["spec"]["method"] == m]
            steps = sorted({c[0] for cur in curves for c in cur})
            by_step = {s: [c[2] for cur in curves for c in cur if c[0] == s] for s in steps}
            mean = [statistics.fmean(by_step[s]) for s in steps]
            line, = ax.plot(steps, mean, marker=".", label=f"{m} (lr {summary[n]['methods'][m]['lr']:g})")
            ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                            color=line.get_color(), alpha=0.15)
        ax.axhline(summary[n]["target_val_loss"], color="gray", linestyle="--", linewidth=1, label="target")
        ax.set_title(f"{title} n_train={n}".strip())
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
