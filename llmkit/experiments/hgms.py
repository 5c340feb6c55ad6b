"""What ``bench/hgms.py`` measures: HG-MS against uniform, DoReMi, DoGE and ODM source weighting at a matched
training budget, on a clean and a corrupted GSM8K source.

Every method trains the same model with LoRA on its last layers through the recipe's ``make_trainer`` (same
seed, optimizer, steps, batch size and sequence length); ``run_method`` records the weights over steps, the
extra example-passes and seconds spent on weighting, and the held-out losses of the final model;
``summarize`` gives means with 95% t-intervals over seeds (``stats.mean_ci``) and differences to uniform
paired by seed; ``plot`` draws the corrupted source's weight and the held-out losses. Results:
bench/results/hgms_quick.md.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from llmkit.experiments.stats import mean_ci

METHODS = ("uniform", "hgms", "doremi", "doge", "odm")  # uniform first: DoReMi's reference
MODEL = "smollm2-135m-instruct"
N_LAYERS = 30  # the bundled model's decoder layers (LoRA goes on the last ``lora_layers``)

QUICK = {"steps": 12, "batch": 2, "max_length": 128, "interval": 3, "probe": 4, "iters": 5, "n_clean": 96,
         "n_noisy": 96, "n_target": 32, "n_heldout": 24, "n_math": 12, "lora_layers": 4, "lr": 2e-3,
         "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 0, "seeds": 2, "corruption": "random_words"}
FULL = {"steps": 60, "batch": 4, "max_length": 128, "interval": 6, "probe": 4, "iters": 8, "n_clean": 256,
        "n_noisy": 256, "n_target": 64, "n_heldout": 64, "n_math": 32, "lora_layers": 4, "lr": 2e-3,
        "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 32, "seeds": 3, "corruption": "random_words"}


def _print(msg: str) -> None:
    print(msg, flush=True)


def lora_targets(n_layers_total: int, last: int) -> list[str]:
    """The attention q/v projections of the last ``last`` decoder layers."""
    return [f"model.layers.{i}.self_attn.{m}" for i in range(n_layers_total - last, n_layers_total)
            for m in ("q_proj", "v_proj")]


def build_data(cfg: dict, data_dir: str | Path, work: str | Path) -> tuple[dict, dict]:
    """``(files, heldout)``: the clean / corrupted / target mixture written under ``work/data`` from
    ``data_dir/gsm8k/train.jsonl``, and the held-out GSM8K test and MATH-500 rows."""
    from llmkit.train.common import load_records
    from llmkit.train.hgms.mixtures import gsm8k_noisy_mixture

    data_dir = Path(data_dir)
    files = gsm8k_noisy_mixture(data_dir / "gsm8k" / "train.jsonl", Path(work) / "data", cfg["n_clean"],
                                cfg["n_noisy"], cfg["n_target"], seed=0, corruption=cfg["corruption"])
    heldout = {"gsm8k": load_records(str(data_dir / "gsm8k" / "test.jsonl"), limit=cfg["n_heldout"]),
               "math500": load_records(str(data_dir / "math500" / "test.jsonl"), limit=cfg["n_math"])}
    return files, heldout


def run_method(method: str, cfg: dict, files: dict, work: Path, reference: str | None, heldout: dict,
               seed: int = 0, gsm8k_test: str | Path | None = None) -> dict:
    """Train one method for one seed and measure it. ``reference``: DoReMi's reference model (the uniform
    run's final model). ``gsm8k_test``: the JSONL the accuracy eval reads when ``cfg["acc_n"]`` is set."""
    from trl import ModelConfig

    from llmkit.train.common import completion_loss
    from llmkit.train.hgms.config import HgmsArguments, HgmsConfig
    from llmkit.train.hgms.recipe import make_trainer

    out = Path(work) / f"{method}-s{seed}"
    hg = HgmsArguments(sources=[{"name": "gsm8k", "path": str(files["gsm8k"])},
                                {"name": "noisy", "path": str(files["noisy"])}],
                       target_data=str(files["target"]), max_target_samples=None, weighting=method,
                       weights_update_interval=cfg["interval"], weights_lr=cfg["weights_lr"],
                       probe_batch_size=cfg["probe"], hgms_last_layers=2, hgms_lanczos_iters=cfg["iters"],
                       hgms_select_lr=cfg["select_lr"], doremi_reference_model=reference,
                       doremi_reference_steps=cfg["steps"])
    ta = HgmsConfig(output_dir=str(out), max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
                    per_device_eval_batch_size=8, learning_rate=cfg["lr"], lr_scheduler_type="constant",
                    max_length=cfg["max_length"], logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, bf16=False, seed=seed, dataloader_num_workers=0, disable_tqdm=True)
    ma = ModelConfig(model_name_or_path=MODEL, use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0,
                     lora_target_modules=lora_targets(N_LAYERS, cfg["lora_layers"]))
    trainer, tok, target_rows, _ = make_trainer(hg, ta, ma, out=out)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    c = trainer.hgms
    res = {"method": method, "seed": seed, "train_s": train_s, "weight_refusals": c.refused,
           "s_per_step": train_s / cfg["steps"], "weighting_s": c.update_seconds, "weight_updates": c.updates,
           "extra_passes": c.passes, "selection_examples": c.select_examples,
           "train_tokens": int(trainer._total_train_tokens), "source_examples": dict(zip(c.names, c.source_examples)),
           "final_weights": c.weights_dict(), "history": c.history}
    model = trainer.model
    res["target_loss"] = completion_loss(model, tok, target_rows, max_length=256)
    res["heldout_loss"] = completion_loss(model, tok, heldout["gsm8k"], max_length=256)
    res["math500_loss"] = completion_loss(model, tok, heldout["math500"], max_length=384)
    if method == "uniform":  # DoReMi's reference: saved before the accuracy eval merges the adapter
        trainer.save_model(str(out / "final"))
        res["model_dir"] = str(out / "final")
    if cfg["acc_n"]:
        from llmkit.engines.hf import HFEngine
        from llmkit.evals.harness import run_eval

        merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
        s = run_eval("gsm8k", HFEngine(model=merged.eval(), tokenizer=tok, batch_size=16), data=str(gsm8k_test),
                     limit=cfg["acc_n"], max_new_tokens=256, progress=False)
        res["heldout_accuracy"] = s["accuracy"]
    del trainer, model
    gc.collect()
    return res


def run_line(r: dict) -> str:
    """The printed line of one run."""
    p = r["extra_passes"]
    return (f"{r['method']} seed {r['seed']}: heldout_loss {r['heldout_loss']:.4f}  math500_loss "
            f"{r['math500_loss']:.4f}  target_loss {r['target_loss']:.4f}  weight_noisy "
            f"{r['final_weights']['noisy']:.3f}  s/step {r['s_per_step']:.2f}  extra fwd/bwd/hvp example-passes "
            f"{p['forward']}/{p['backward']}/{p['double_backward']}  refusals {r['weight_refusals']}"
            + (f"  accuracy {r['heldout_accuracy']:.3f}" if "heldout_accuracy" in r else ""))


def run_all(cfg: dict, methods, files: dict, work: Path, heldout: dict, gsm8k_test=None, run=run_method,
            log: Callable[[str], None] = _print, store=None, train=None,
            train_seeds=None) -> dict[str, list[dict]]:
    """``{method: [run per seed]}``; per seed, uniform runs first and its final model is DoReMi's reference.

    ``store`` (a ``harness.ResultStore``): each run is saved as ``<method>-s<seed>`` when it finishes and a
    saved run is loaded instead of retrained, so a long comparison can stop, resume and be split over
    processes. ``train`` (default: every method) names the methods this invocation may train; the others
    come from the store only, and a run in neither is left out (see ``missing_runs``); ``train_seeds`` (default:
    every seed) does the same for seeds, so one method's seeds can be split over processes too."""
    runs: dict[str, list[dict]] = {m: [] for m in METHODS if m in methods}
    train = set(runs if train is None else train)
    train_seeds = set(range(cfg["seeds"]) if train_seeds is None else train_seeds)
    for seed in range(cfg["seeds"]):
        reference = None
        for m in list(runs):
            r = store.load(f"{m}-s{seed}") if store is not None else None
            if r is None and (m not in train or seed not in train_seeds):
                continue
            if r is None:
                if m == "doremi" and reference is None:
                    log("doremi: no uniform model for this seed; it trains its own uniform reference")
                r = run(m, cfg, files, work, reference if m == "doremi" else None, heldout, seed, gsm8k_test)
                r["steps"] = cfg["steps"]
                model_dir = r.pop("model_dir", None)
                if store is not None:
                    store.save(f"{m}-s{seed}", r)
            else:
                model_dir = str(Path(work) / f"uniform-s{seed}" / "final") if m == "uniform" else None
                if model_dir and not Path(model_dir).is_dir():
                    model_dir = None  # saved elsewhere: DoReMi (if it still has to run) trains its own reference
            if m == "uniform":
                reference = model_dir
            runs[m].append(r)
            log(run_line(r))
    return runs


def missing_runs(runs: dict[str, list[dict]], cfg: dict) -> list[str]:
    """``<method>-s<seed>`` of every run the summary still needs."""
    return [f"{m}-s{seed}" for m, rs in runs.items() for seed in range(cfg["seeds"])
            if seed not in {r["seed"] for r in rs}]


def _ci(values) -> tuple[float, list[float]]:
    c = mean_ci(values)
    return c["mean"], [float(c["lo"]), float(c["hi"])]


def fmt_ci(summary: dict, key: str, spec: str = ".4f") -> str:
    lo, hi = summary[key + "_ci"]
    return f"{summary[key]:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def summarize(runs: dict[str, list[dict]], cfg: dict, log: Callable[[str], None] = _print) -> dict:
    """Means with 95% t-intervals over seeds (``<key>_<method>`` and ``<key>_<method>_ci``), step-time ratios
    against uniform, and held-out loss differences to uniform paired by seed."""
    summary: dict = {"seeds": cfg["seeds"]}
    for m, rs in runs.items():
        for key, vals in (("heldout_loss", [r["heldout_loss"] for r in rs]),
                          ("math500_loss", [r["math500_loss"] for r in rs]),
                          ("weight_noisy", [r["final_weights"]["noisy"] for r in rs]),
                          ("heldout_accuracy", [r["heldout_accuracy"] for r in rs if "heldout_accuracy" in r])):
            if vals:
                summary[f"{key}_{m}"], summary[f"{key}_{m}_ci"] = _ci(vals)
        summary[f"final_weights_{m}"] = {n: float(np.mean([r["final_weights"][n] for r in rs]))
                                         for n in rs[0]["final_weights"]}
        updates = sum(r["weight_updates"] for r in rs)
        if m in ("hgms", "doremi", "doge") and updates:  # the trust rule's share of refused updates
            summary[f"refused_share_{m}"] = sum(r["weight_refusals"] for r in rs) / updates
        log(f"{m}: heldout_loss {fmt_ci(summary, f'heldout_loss_{m}')}  weight_noisy "
            f"{fmt_ci(summary, f'weight_noisy_{m}')}"
            + (f"  accuracy {fmt_ci(summary, f'heldout_accuracy_{m}')}" if f"heldout_accuracy_{m}" in summary
               else ""))
    if "uniform" in runs:
        base = float(np.mean([r["s_per_step"] for r in runs["uniform"]]))
        for m, rs in runs.items():
            summary[f"step_time_ratio_{m}"] = float(np.mean([r["s_per_step"] for r in rs])) / base
            # load-independent view: each run's own time with and without its weight updates
            summary[f"in_run_overhead_ratio_{m}"] = float(np.mean(
                [r["train_s"] / max(r["train_s"] - r["weighting_s"], 1e-9) for r in rs]))
            if m != "uniform":
                d = [r["heldout_loss"] - u["heldout_loss"] for r, u in zip(rs, runs["uniform"])]
                k = f"heldout_loss_diff_{m}_vs_uniform"
                summary[k], summary[k + "_ci"] = _ci(d)
                log(f"heldout_loss {m} - uniform (paired by seed): {fmt_ci(summary, k, '+.4f')}")
        if "hgms" in runs:
            summary["overhead_ratio_vs_uniform"] = summary["step_time_ratio_hgms"]
            log(f"overhead_ratio_vs_uniform (HG-MS s/step over uniform s/step, same run): "
                f"{summary['overhead_ratio_vs_uniform']:.3f}")
    if "doremi" in runs and "uniform" in runs:
        summary["doremi_reference_cost_steps"] = cfg["steps"]  # the uniform run it needs first
    return summary


def plot(runs: dict, summary: dict, path: str | Path, title: str) -> None:
    """The corrupted source's weight over steps (seed 0) and the held-out losses with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, rs in runs.items():
        r = rs[0]  # seed 0's trajectory
        steps = [h["step"] for h in r["history"]]
        a.step(steps + [r["steps"]], [h["weights"]["noisy"] for h in r["history"]]
               + [r["history"][-1]["weights"]["noisy"]], where="post", label=m, marker=".")
    a.axhline(0.5, color="gray", lw=0.8, ls="--")
    a.set_xlabel("optimizer step")
    a.set_ylabel("weight of the corrupted source (seed 0)")
    a.set_title("learned weights (lower is right)")
    a.legend()
    names = list(runs)
    x = range(len(names))
    for off, key, label in ((-0.2, "heldout_loss", "GSM8K test loss"), (0.2, "math500_loss", "MATH-500 loss")):
        mean = [summary[f"{key}_{m}"] for m in names]
        err = [[mu - summary[f"{key}_{m}_ci"][0] for mu, m in zip(mean, names)],
               [summary[f"{key}_{m}_ci"][1] - mu for mu, m in zip(mean, names)]]
        b.bar([i + off for i in x], mean, 0.4, yerr=err, capsize=3, label=label)
    lo = min(min(summary[f"heldout_loss_{m}_ci"][0], summary[f"math500_loss_{m}_ci"][0]) for m in names)
    hi = max(max(summary[f"heldout_loss_{m}_ci"][1], summary[f"math500_loss_{m}_ci"][1]) for m in names)
    b.set_ylim(lo - 0.1 * (hi - lo + 0.1), hi + 0.1 * (hi - lo + 0.1))
    b.set_xticks(list(x), names)
    b.set_ylabel("completion NLL (nats/token)")
    b.set_title("held-out loss of the final model (mean, 95% CI over seeds)")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
