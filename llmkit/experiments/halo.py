"""The HALO comparison (``bench/halo.py``): full finetuning, step-wise unfreezing, LISA and HALO on one SFT workload.

A comparison is:

  1. For each schedule and training size, a learning-rate sweep: one run per candidate rate at seed 0 on
     that size, scored by the completion loss on a *sweep split* (GSM8K train rows outside the training pool
     and disjoint from the reported validation set, so picking the rate does not peek at the numbers we
     report); the lowest loss wins (``pick_best_lr``, over ``harness.lr_sweep``). ``rates_per_size`` with
     ``per_size=False`` is the earlier protocol: one sweep at the smallest size, used for every size.
  2. Every schedule at its own best rate for the size, for each training size and seed: a seeded subset of
     the training pool (``train_subset``: the first n rows of a seed's permutation, so the small set is inside
     the large one), a seeded data order, validation loss (GSM8K test) every ``eval_every`` steps, and
     forgetting = completion loss on a set the run never trains on (MATH-500 solutions), after minus before.
  3. ``summarize_runs``: per size, target = initial validation loss minus ``target_frac`` of full
     finetuning's mean improvement; per schedule the mean and spread (sample std over seeds) of final
     validation loss, forgetting, train seconds and optimizer state, and steps to target with the runs that
     never reach it counted as censored (``reached`` = how many did), never as the step budget.

``train_run`` trains one copy of a model with the recipe's ``HaloSFTTrainer`` (AdamW, constant rate, no warmup:
a 1-step warmup starts at rate 0 and wastes a sixth of a 6-step run), so the bench measures the shipped code
path. ``Runs`` keeps every finished run as a part in a ``harness.ResultStore`` keyed by its ``RunSpec`` and
data settings, so a comparison is built over several invocations and a rerun skips what is done.
Measured figures: bench/results/halo.md.
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

from llmkit.experiments.harness import ResultStore, lr_sweep, resolve_preset
from llmkit.train.common import save_figure
from llmkit.train.halo.schedule import METHODS

MODEL = "smollm2-135m-instruct"
QUICK = {"steps": 6, "batch": 2, "max_length": 128, "eval_every": 3, "sizes": "8,64", "seeds": 3, "n_val": 24,
         "n_forget": 16, "n_sweep": 16, "lrs": "3e-5,1e-4,3e-4", "pool": 1000, "forget_max_length": 192}
FULL = {"steps": 20, "batch": 2, "max_length": 128, "eval_every": 5, "sizes": "8,32", "seeds": 3, "n_val": 24,
        "n_forget": 16, "n_sweep": 16, "lrs": "3e-6,1e-5,3e-5,1e-4,3e-4,1e-3", "pool": 1000, "forget_max_length": 192}
SWEEP_ROWS_FROM = 7000  # GSM8K train rows from here on form the sweep split (the pool is the first `pool` rows)
DATA_KEYS = ("n_val", "n_forget", "n_sweep", "pool", "forget_max_length")
SCHEDULES = ("full", "halo", "lisa", "stepwise")  # the order runs are made and reported in


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


def pick_best_lr(losses: dict[float, float | None]) -> float:
    """The learning rate with the lowest (finite) sweep loss; ties go to the smaller rate, a missing run never wins."""
    return lr_sweep(lambda lr: math.nan if losses[lr] is None else losses[lr], losses)["best_lr"]


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
    # statistics.stdev, not stats.mean_ci's std: its rounded mean gives ~1e-13 instead of 0 for equal values
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
    from llmkit.train.halo.trainer import HaloSFTTrainer

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
    trainer = HaloSFTTrainer(
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
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- the comparison, step by step


def resolve_config(quick: bool, overrides: dict) -> dict:
    """The preset (``QUICK`` or ``FULL``) with every override that is not None."""
    return resolve_preset(FULL, QUICK, quick, overrides)


def run_settings(cfg: dict, homotopy_fraction: float = 0.5, ramp_width: float = 0.25, lisa_layers: int = 2) -> dict:
    """The ``RunSpec`` fields every run of one comparison shares; LISA resamples about five times per run."""
    return {"steps": cfg["steps"], "batch": cfg["batch"], "max_length": cfg["max_length"],
            "eval_every": cfg["eval_every"], "homotopy_fraction": homotopy_fraction, "ramp_width": ramp_width,
            "lisa_layers": lisa_layers, "lisa_interval": max(2, cfg["steps"] // 5)}


def load_workload(data: str | Path, cfg: dict, model: str = MODEL, log: Callable[[str], None] = print) -> dict:
    """The base model, the row sets (``pool``, ``sweep``, ``val``, ``forget``) and the base model's losses."""
    from llmkit.models import load
    from llmkit.train.common import completion_loss, load_records

    data = Path(data)
    base, tok = load(model)
    gsm_train = str(data / "gsm8k/train.jsonl")
    w = {"base": base, "tok": tok, "pool": load_records(gsm_train, limit=cfg["pool"]),
         "sweep": load_records(gsm_train, limit=SWEEP_ROWS_FROM + cfg["n_sweep"])[SWEEP_ROWS_FROM:],
         "val": load_records(str(data / "gsm8k/test.jsonl"), limit=cfg["n_val"]),
         "forget": load_records(str(data / "math500/test.jsonl"), limit=cfg["n_forget"])}
    w["init_forget"] = completion_loss(base, tok, w["forget"], max_length=cfg["forget_max_length"], batch_size=8)
    w["init_val"] = completion_loss(base, tok, w["val"], max_length=cfg["max_length"], batch_size=8)
    log(f"initial val loss {w['init_val']:.4f}, forget-set loss {w['init_forget']:.4f}")
    return w


class Runs:
    """``runs(kind, spec, with_val)``: a saved run, or a new one trained and saved, or None.

    ``kind`` is ``"sweep"`` (scored on the sweep split) or ``"run"`` (validation curve and forgetting). A part
    counts only when it was made with the same ``RunSpec`` and data settings (``store.config``); schedules not
    in ``train`` are only read (``train=()`` trains nothing). ``workload`` is called once, on the first run that
    has to be trained, so reading finished parts loads no model.
    """

    def __init__(self, store: ResultStore, workload: Callable[[], dict], *, train: Iterable[str] = SCHEDULES,
                 out_dir: str | Path = "/tmp", log: Callable[[str], None] = print):
        self.store, self.make_workload, self.train = store, workload, tuple(train)
        self.out_dir, self.log = out_dir, log
        self._workload: dict | None = None

    @property
    def data(self) -> dict:
        return self.store.config

    def workload(self) -> dict:
        if self._workload is None:
            self._workload = self.make_workload()
        return self._workload

    def __call__(self, kind: str, spec: RunSpec, with_val: bool) -> dict | None:
        name, config = f"{kind}_{spec.key()}", {"spec": spec.as_dict(), "data": self.data}
        r = self.store.load(name, config)
        if r is not None or spec.method not in self.train:
            return r
        w = self.workload()
        self.log(f"[{kind}] {spec.key()} ...")
        r = train_run(w["base"], w["tok"], train_subset(w["pool"], spec.n_train, spec.seed), spec,
                      val_rows=w["val"] if with_val else None, initial_val=w["init_val"],
                      end_sets={"forget": w["forget"]} if with_val else {"sweep": w["sweep"]},
                      end_max_length=self.data["forget_max_length"] if with_val else None,
                      out_dir=self.out_dir, log=self.log)
        r["data"] = self.data
        if with_val:
            r["initial_val"] = r["curve"][0][2]
            r["forgetting"] = r["end_losses"]["forget"] - w["init_forget"]
        self.store.save(name, r, config)
        self.log(f"[{kind}] {spec.key()} done: {r['end_losses']}, train s {r['train_s']:.1f}")
        return r


def sweep_rates(runs: Runs, sizes: Sequence[int], lrs: Sequence[float], common: dict,
                log: Callable[[str], None] = print) -> dict:
    """``sweep[schedule][size][rate]`` = sweep loss (None where the run is neither saved nor trained here)."""
    sweep: dict = {m: {} for m in SCHEDULES}
    for n in sizes:
        for m in SCHEDULES:
            scores = {}
            for lr in lrs:
                r = runs("sweep", RunSpec(method=m, lr=lr, seed=0, n_train=n, **common), with_val=False)
                scores[lr] = r["end_losses"]["sweep"] if r else None
            sweep[m][n] = scores
            if any(v is not None for v in scores.values()):
                log(f"sweep {m} n={n}: " + ", ".join(f"lr {lr:g}: {v:.4f}" if v is not None else
                                                     f"lr {lr:g}: (not run)" for lr, v in scores.items())
                    + f" -> {pick_best_lr(scores):g}")
    return sweep


def sweep_json(sweep: dict) -> dict:
    return {m: {str(n): {f"{lr:g}": v for lr, v in sc.items()} for n, sc in per_n.items()}
            for m, per_n in sweep.items()}


def comparison_runs(runs: Runs, rates: dict[tuple[str, int], float], seeds: Sequence[int], sizes: Sequence[int],
                    common: dict) -> list[dict]:
    """Every schedule at its own rate, seed-major so that an interrupted comparison still covers every size."""
    out = []
    for seed in seeds:
        for n in sizes:
            for m in SCHEDULES:
                if (m, n) in rates:
                    r = runs("run", RunSpec(method=m, lr=rates[m, n], seed=seed, n_train=n, **common), with_val=True)
                    if r is not None:
                        out.append(r)
    return out


def build_report(runs: Sequence[dict], sweep: dict, config: dict, target_frac: float = 0.8) -> tuple[dict, dict]:
    """``(report, summary)``: the bench's JSON (config, flat figures, sweep, per-size summary, runs without their
    per-step training losses) and the per-size summary with integer keys (for ``plot_summary``)."""
    summary = summarize_runs(runs, target_frac)
    figures = flat_figures(summary, primary_n=max(summary))
    figures["seeds"] = len({r["spec"]["seed"] for r in runs})
    figures["sizes"] = sorted(summary)
    report = {"config": {**config, "model": MODEL, "units": runs[0]["units"], "data": data_description(config)},
              "figures": figures, "sweep": sweep_json(sweep), "summary": {str(n): s for n, s in summary.items()},
              "runs": [{k: v for k, v in r.items() if k != "train_losses"} for r in runs]}
    return report, summary


def data_description(cfg: dict) -> dict:
    return {"pool": f"gsm8k/train.jsonl rows 0-{cfg['pool'] - 1}",
            "sweep": f"gsm8k/train.jsonl rows {SWEEP_ROWS_FROM}-{SWEEP_ROWS_FROM + cfg['n_sweep'] - 1}",
            "val": f"gsm8k/test.jsonl first {cfg['n_val']}", "forget": f"math500/test.jsonl first {cfg['n_forget']}"}


def figure_lines(figures: dict) -> list[str]:
    """One printed line per figure (rates in %g, other floats to 4 decimals)."""
    return [f"{k}: {v:g}" if k.startswith("lr_") else f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
            for k, v in figures.items()]
