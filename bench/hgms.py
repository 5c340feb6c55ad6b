"""HG-MS vs uniform, DoReMi, DoGE and ODM source weighting at a matched training budget.

Mixture (built at run time from ../shared/data/gsm8k/train.jsonl by
``llmkit.train.hgms.mixtures.gsm8k_noisy_mixture``; disjoint random slices):

- ``gsm8k``: clean GSM8K train problems -- should gain weight;
- ``noisy``: other GSM8K train problems with the answers shuffled across questions (fluent, but
  the answer belongs to another question) -- should lose weight;
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

    .venv/bin/python bench/hgms.py --quick     # smoke run: 12 steps x 2 examples x 128 tokens
    .venv/bin/python bench/hgms.py             # the FULL preset below

Writes bench/results/hgms[_quick].json and .png (weight of the noisy source over steps per method;
held-out losses per method).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"
METHODS = ("uniform", "hgms", "doremi", "doge", "odm")  # uniform first: DoReMi's reference

QUICK = {"steps": 12, "batch": 2, "max_length": 128, "interval": 3, "probe": 4, "iters": 5, "n_clean": 96,
         "n_noisy": 96, "n_target": 32, "n_heldout": 24, "n_math": 12, "lora_layers": 4, "lr": 2e-3,
         "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 0}
FULL = {"steps": 40, "batch": 4, "max_length": 160, "interval": 4, "probe": 4, "iters": 8, "n_clean": 256,
        "n_noisy": 256, "n_target": 64, "n_heldout": 64, "n_math": 32, "lora_layers": 4, "lr": 2e-3,
        "weights_lr": 0.5, "select_lr": 0.01, "acc_n": 32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run (preset QUICK)")
    for k, v in FULL.items():
        p.add_argument(f"--{k}", type=type(v), help=f"override the preset (full: {v}, quick: {QUICK[k]})")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--work", default=str(REPO / "outputs" / "hgms-bench"), help="scratch folder (data, models)")
    return p.parse_args()


def lora_targets(n_layers_total: int, last: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.{m}" for i in range(n_layers_total - last, n_layers_total)
            for m in ("q_proj", "v_proj")]


def run_method(method: str, cfg: dict, files: dict, work: Path, reference: str | None, heldout: dict):
    from trl import ModelConfig

    from llmkit.train.common import completion_loss
    from llmkit.train.hgms.config import HgmsArguments, HgmsConfig
    from llmkit.train.hgms.recipe import make_trainer

    out = work / method
    hg = HgmsArguments(sources=[{"name": "gsm8k", "path": str(files["gsm8k"])},
                                {"name": "noisy", "path": str(files["noisy"])}],
                       target_data=str(files["target"]), max_target_samples=None, weighting=method,
                       weights_update_interval=cfg["interval"], weights_lr=cfg["weights_lr"],
                       probe_batch_size=cfg["probe"], hgms_last_layers=2, hgms_lanczos_iters=cfg["iters"],
                       hgms_select_lr=cfg["select_lr"], doremi_reference_model=reference)
    ta = HgmsConfig(output_dir=str(out), max_steps=cfg["steps"], per_device_train_batch_size=cfg["batch"],
                    per_device_eval_batch_size=8, learning_rate=cfg["lr"], lr_scheduler_type="constant",
                    max_length=cfg["max_length"], logging_steps=1, save_strategy="no", report_to="none",
                    use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    ma = ModelConfig(model_name_or_path="smollm2-135m-instruct", use_peft=True, lora_r=8, lora_alpha=16,
                     lora_dropout=0.0, lora_target_modules=lora_targets(30, cfg["lora_layers"]))
    trainer, tok, target_rows, _ = make_trainer(hg, ta, ma, out=out)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    c = trainer.hgms
    res = {"method": method, "train_s": train_s, "s_per_step": train_s / cfg["steps"],
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


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, r in results.items():
        steps = [h["step"] for h in r["history"]]
        a.step(steps + [r["steps"]], [h["weights"]["noisy"] for h in r["history"]]
               + [r["history"][-1]["weights"]["noisy"]], where="post", label=m, marker=".")
    a.axhline(0.5, color="gray", lw=0.8, ls="--")
    a.set_xlabel("optimizer step")
    a.set_ylabel("weight of the shuffled-answers source")
    a.set_title("learned weights (lower is right)")
    a.legend()
    names = list(results)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [results[m]["heldout_loss"] for m in names], 0.4, label="GSM8K test loss")
    b.bar([i + 0.2 for i in x], [results[m]["math500_loss"] for m in names], 0.4, label="MATH-500 loss")
    lo = min(min(results[m]["heldout_loss"], results[m]["math500_loss"]) for m in names)
    hi = max(max(results[m]["heldout_loss"], results[m]["math500_loss"]) for m in names)
    b.set_ylim(lo - 0.1 * (hi - lo + 0.1), hi + 0.1 * (hi - lo + 0.1))
    b.set_xticks(list(x), names)
    b.set_ylabel("completion NLL (nats/token)")
    b.set_title("held-out loss of the final model")
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
                                cfg["n_target"], seed=0)
    heldout = {"gsm8k": load_records(str(DATA / "gsm8k" / "test.jsonl"), limit=cfg["n_heldout"]),
               "math500": load_records(str(DATA / "math500" / "test.jsonl"), limit=cfg["n_math"])}
    results: dict[str, dict] = {}
    reference = None
    for m in [x for x in METHODS if x in args.methods]:
        if m == "doremi" and reference is None:
            print("doremi: no uniform run in this invocation; its reference is the starting model", flush=True)
        r = run_method(m, cfg, files, work, reference if m == "doremi" else None, heldout)
        r["steps"] = cfg["steps"]
        if m == "uniform":
            reference = r.pop("model_dir")
        results[m] = r
        p = r["extra_passes"]
        print(f"{m}: heldout_loss {r['heldout_loss']:.4f}  math500_loss {r['math500_loss']:.4f}  "
              f"target_loss {r['target_loss']:.4f}  weight_noisy {r['final_weights']['noisy']:.3f}  "
              f"s/step {r['s_per_step']:.2f}  extra fwd/bwd/hvp example-passes {p['forward']}/{p['backward']}/"
              f"{p['double_backward']}  train_tokens {r['train_tokens']}"
              + (f"  accuracy {r['heldout_accuracy']:.3f}" if "heldout_accuracy" in r else ""), flush=True)

    summary: dict[str, float | int | None] = {}
    for m, r in results.items():
        summary[f"heldout_loss_{m}"] = r["heldout_loss"]
        summary[f"math500_loss_{m}"] = r["math500_loss"]
        summary[f"weight_noisy_{m}"] = r["final_weights"]["noisy"]
        if "heldout_accuracy" in r:
            summary[f"heldout_accuracy_{m}"] = r["heldout_accuracy"]
    if "uniform" in results:
        base = results["uniform"]["s_per_step"]
        for m, r in results.items():
            summary[f"step_time_ratio_{m}"] = r["s_per_step"] / base
        if "hgms" in results:
            summary["overhead_ratio_vs_uniform"] = results["hgms"]["s_per_step"] / base
            print(f"overhead_ratio_vs_uniform (HG-MS s/step over uniform s/step, same run): "
                  f"{summary['overhead_ratio_vs_uniform']:.3f}", flush=True)
        for m, r in results.items():
            # load-independent view: the run's own time with and without its weight updates
            summary[f"in_run_overhead_ratio_{m}"] = r["train_s"] / max(r["train_s"] - r["weighting_s"], 1e-9)
            print(f"{m}: weighting share of train time {r['weighting_s'] / r['train_s']:.3f} "
                  f"(in-run overhead ratio {summary[f'in_run_overhead_ratio_{m}']:.3f}); "
                  f"{r['weight_updates']} updates; examples per source {r['source_examples']}", flush=True)
        for m in results:
            if m != "uniform":
                d = results[m]["heldout_loss"] - results["uniform"]["heldout_loss"]
                print(f"heldout_loss {m} - uniform: {d:+.4f}", flush=True)
    if "doremi" in results and "uniform" in results:
        summary["doremi_reference_cost_steps"] = cfg["steps"]  # the uniform run it needs first
    name = "hgms_quick" if args.quick else "hgms"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"config": cfg, "summary": summary, "methods": results},
                                                     indent=1) + "\n")
    plot(results, RESULTS / f"{name}.png",
         f"SmolLM2-135M LoRA, {cfg['steps']} steps x {cfg['batch']} examples x <= {cfg['max_length']} tokens")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
