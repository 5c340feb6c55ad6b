"""HG-MS vs uniform, DoReMi, DoGE and ODM source weighting at a matched training budget.

Mixture (built at run time from ../shared/data/gsm8k/train.jsonl by
``llmkit.train.hgms.mixtures.gsm8k_noisy_mixture``; disjoint random slices):

- ``gsm8k``: clean GSM8K train problems -- should gain weight;
- ``noisy``: other GSM8K train problems with each answer replaced by random words from the answers'
  vocabulary (``--corruption random_words``, the default: clearly harmful) or shuffled across
  questions (``shuffled``: fluent, but the answer belongs to another question) -- should lose weight;
- target (outer objective, DoGE's target): a third GSM8K train slice, a validation set.

Held out (never trained on, never used for weighting): GSM8K test completion loss (and, with
``--acc_n``, greedy accuracy on that many test problems), MATH-500 solution loss.

Every method trains the bundled SmolLM2-135M-Instruct with LoRA on the last layers, through the same
``HgmsSFTTrainer`` the recipe uses, with the same seed, optimizer, steps, batch size and sequence
length: the same number of training examples per step and in total (``train_tokens`` reports the
tokens actually seen; they differ only by the length of the examples drawn). The extra
forward/backward/double-backward example-passes each method spends on weighting are reported beside
it, and ``overhead_ratio_vs_uniform`` is (HG-MS train seconds per step) / (uniform train seconds per
step) from the same invocation; because the machine is shared and its load drifts between the runs,
``in_run_overhead_ratio_<method>`` also gives each run's train time over its train time minus the
seconds spent in weight updates (same run, same load). DoReMi's reference model is the uniform run's final model (DoReMi
trains its reference on the uniform mixture), so its extra cost includes that run.

    .venv/bin/python bench/hgms.py --quick     # smoke run: 12 steps x 2 examples x 128 tokens, 2 seeds
    .venv/bin/python bench/hgms.py             # the FULL preset below (150 steps, 3 seeds)

Every figure is a mean over training seeds with a 95% t-interval (``<key>_ci``); differences to
uniform are paired by seed (``heldout_loss_diff_<method>_vs_uniform``).

Writes bench/results/hgms[_quick].json and .png (weight of the noisy source over steps per method;
held-out losses per method).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"
METHODS = ("uniform", "hgms", "doremi", "doge", "odm")  # uniform first: DoReMi's reference

QUICK = {"steps": 12, "batch": 2, "max_length": 128, "interval": 3, "probe": 4, "iters": 5, "n_clean": 96,
         "n_noisy": 96, "n_target": 32, "n_heldout": 24, "n_math": 12, "lora_layers": 4, "lr": 2e-3,
         "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 0, "seeds": 2, "corruption": "random_words"}
FULL = {"steps": 150, "batch": 4, "max_length": 160, "interval": 5, "probe": 4, "iters": 8, "n_clean": 256,
        "n_noisy": 256, "n_target": 64, "n_heldout": 64, "n_math": 32, "lora_layers": 4, "lr": 2e-3,
        "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 64, "seeds": 3, "corruption": "random_words"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run (preset QUICK)")
    for k, v in FULL.items():
        p.add_argument(f"--{k}", type=type(v), help=f"override the preset (full: {v}, quick: {QUICK[k]})",
                       **({"choices": ["random_words", "shuffled"]} if k == "corruption" else {}))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--work", default=str(REPO / "outputs" / "hgms-bench"), help="scratch folder (data, models)")
    return p.parse_args()


def lora_targets(n_layers_total: int, last: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.{m}" for i in range(n_layers_total - last, n_layers_total)
            for m in ("q_proj", "v_proj")]


def run_method(method: str, cfg: dict, files: dict, work: Path, reference: str | None, heldout: dict, seed: int = 0):
    from trl import ModelConfig

    from llmkit.train.common import completion_loss
    from llmkit.train.hgms.config import HgmsArguments, HgmsConfig
    from llmkit.train.hgms.recipe import make_trainer

    out = work / f"{method}-s{seed}"
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
    ma = ModelConfig(model_name_or_path="smollm2-135m-instruct", use_peft=True, lora_r=8, lora_alpha=16,
                     lora_dropout=0.0, lora_target_modules=lora_targets(30, cfg["lora_layers"]))
    trainer, tok, target_rows, _ = make_trainer(hg, ta, ma, out=out)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    c = trainer.hgms
    res = {"method": method, "seed": seed, "train_s": train_s, "weight_refusals": trainer.hgms.refused, "s_per_step": train_s / cfg["steps"],
           "weighting_s": c.update_seconds, "weight_updates": c.updates, "extra_passes": c.passes,
           "selection_examples": c.select_examples, "train_tokens": int(trainer._total_train_tokens),
           "source_examples": dict(zip(c.names, c.source_examples)), "final_weights": c.weights_dict(),
           "history": c.history}
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
        s = run_eval("gsm8k", HFEngine(model=merged.eval(), tokenizer=tok, batch_size=16),
                     data=str(DATA / "gsm8k" / "test.jsonl"), limit=cfg["acc_n"], max_new_tokens=256, progress=False)
        res["heldout_accuracy"] = s["accuracy"]
    del trainer, model
    gc.collect()
    return res


def mean_ci(values: list[float]) -> tuple[float, list[float]]:
    """Mean and 95% t-interval over seeds (the interval collapses to the mean for one seed)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    m = float(x.mean())
    if len(x) < 2 or float(x.std()) == 0.0:
        return m, [m, m]
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=m, scale=stats.sem(x))
    return m, [float(lo), float(hi)]


def fmt_ci(summary: dict, key: str, spec: str = ".4f") -> str:
    lo, hi = summary[key + "_ci"]
    return f"{summary[key]:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def plot(runs: dict, summary: dict, path: Path, title: str) -> None:
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


def main() -> None:
    import torch

    from llmkit.train.common import load_records
    from llmkit.train.hgms.mixtures import gsm8k_noisy_mixture

    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    work = Path(args.work) / ("quick" if args.quick else "full")
    files = gsm8k_noisy_mixture(DATA / "gsm8k" / "train.jsonl", work / "data", cfg["n_clean"], cfg["n_noisy"],
                                cfg["n_target"], seed=0, corruption=cfg["corruption"])
    heldout = {"gsm8k": load_records(str(DATA / "gsm8k" / "test.jsonl"), limit=cfg["n_heldout"]),
               "math500": load_records(str(DATA / "math500" / "test.jsonl"), limit=cfg["n_math"])}
    runs: dict[str, list[dict]] = {m: [] for m in METHODS if m in args.methods}
    for seed in range(cfg["seeds"]):
        reference = None
        for m in list(runs):
            if m == "doremi" and reference is None:
                print("doremi: no uniform run in this invocation; it trains its own uniform reference", flush=True)
            r = run_method(m, cfg, files, work, reference if m == "doremi" else None, heldout, seed)
            r["steps"] = cfg["steps"]
            if m == "uniform":
                reference = r.pop("model_dir")
            runs[m].append(r)
            p = r["extra_passes"]
            print(f"{m} seed {seed}: heldout_loss {r['heldout_loss']:.4f}  math500_loss {r['math500_loss']:.4f}  "
                  f"target_loss {r['target_loss']:.4f}  weight_noisy {r['final_weights']['noisy']:.3f}  "
                  f"s/step {r['s_per_step']:.2f}  extra fwd/bwd/hvp example-passes {p['forward']}/{p['backward']}/"
                  f"{p['double_backward']}  refusals {r['weight_refusals']}"
                  + (f"  accuracy {r['heldout_accuracy']:.3f}" if "heldout_accuracy" in r else ""), flush=True)

    summary: dict = {"seeds": cfg["seeds"]}
    for m, rs in runs.items():
        for key, vals in (("heldout_loss", [r["heldout_loss"] for r in rs]),
                          ("math500_loss", [r["math500_loss"] for r in rs]),
                          ("weight_noisy", [r["final_weights"]["noisy"] for r in rs]),
                          ("heldout_accuracy", [r["heldout_accuracy"] for r in rs if "heldout_accuracy" in r])):
            if vals:
                summary[f"{key}_{m}"], summary[f"{key}_{m}_ci"] = mean_ci(vals)
        summary[f"final_weights_{m}"] = {n: float(np.mean([r["final_weights"][n] for r in rs]))
                                         for n in rs[0]["final_weights"]}
        print(f"{m}: heldout_loss {fmt_ci(summary, f'heldout_loss_{m}')}  weight_noisy "
              f"{fmt_ci(summary, f'weight_noisy_{m}')}"
              + (f"  accuracy {fmt_ci(summary, f'heldout_accuracy_{m}')}" if f"heldout_accuracy_{m}" in summary
                 else ""), flush=True)
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
                summary[k], summary[k + "_ci"] = mean_ci(d)
                print(f"heldout_loss {m} - uniform (paired by seed): {fmt_ci(summary, k, '+.4f')}", flush=True)
        if "hgms" in runs:
            summary["overhead_ratio_vs_uniform"] = summary["step_time_ratio_hgms"]
            print(f"overhead_ratio_vs_uniform (HG-MS s/step over uniform s/step, same run): "
                  f"{summary['overhead_ratio_vs_uniform']:.3f}", flush=True)
    if "doremi" in runs and "uniform" in runs:
        summary["doremi_reference_cost_steps"] = cfg["steps"]  # the uniform run it needs first
    name = "hgms_quick" if args.quick else "hgms"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"config": cfg, "summary": summary, "methods": runs},
                                                     indent=1) + "\n")
    plot(runs, summary, RESULTS / f"{name}.png", f"SmolLM2-135M LoRA, {cfg['steps']} steps x {cfg['batch']} "
         f"examples x <= {cfg['max_length']} tokens, {cfg['seeds']} seeds")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
