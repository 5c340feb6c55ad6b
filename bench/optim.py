"""Optimization backends, part 1: toy settings, optimizers in the HALO recipe, Jacobian descent in VSPO.

Three figures, each measured against its anchor in the same run:

1. Toy settings: the seed papers' toy problems are the tests in tests/test_optim_{sign,muon,imuon,mirror,ssn,jd}.py
   (heavy-tailed least squares for SignSGD/Lion/Muon vs SGD, iMuon on Stiefel/Grassmann/SPD/fixed-rank,
   mirror descent on the simplex, semismooth Newton's superlinear rate, UPGrad's conflict-free direction).
   They are run here with pytest and counted: ``toy_tests_passed`` / ``toy_tests_total``.
2. HALO SFT of the bundled model (recipes/configs/halo/smollm2_gsm8k_sft.yaml, shortened) with AdamW (anchor),
   Muon (llmkit_muon on the hidden matrices with Moonlight's AdamW-matched update RMS, so it shares AdamW's lr;
   AdamW on embeddings/head/norms) and Lion (llmkit_lion, lr / 3 as Lion's authors advise), the same steps and
   data: eval-loss ratio and step-time ratio against AdamW.
3. VSPO's GRPO path (mode grpo: the aggregation does not depend on steering) on the bundled model with the
   summed rewards (anchor) and ``reward_aggregation: upgrad``, on two rewards that conflict there (a 10-30 word
   verbosity band and the expertise reward): per-reward curves, the step-time ratio, and evidence that the
   rewards really pull apart (``llmkit.train.reward_aggregation.reward_conflict_stats``: the fraction of groups
   where each reward spreads, the mean in-group cosine of the two rewards, the fraction of groups where they
   rank the rollouts oppositely). Both runs see the same prompts (same seed); they run one after the other.

    .venv/bin/python bench/optim.py --quick    # 2 HALO steps (batch 1), 3 VSPO steps, small eval
    .venv/bin/python bench/optim.py            # 10 HALO steps, 6 VSPO steps

Absolute times on the shared CPU box are noise; ratios are what is reported. Outputs:
bench/results/optim[_quick].json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY_FILES = [f"tests/test_optim_{n}.py" for n in ("sign", "muon", "imuon", "mirror", "ssn", "jd", "zo")]


def run_toys() -> dict:
    import pytest

    class Count:
        def __init__(self):
            self.passed, self.failed, self.names = 0, 0, []

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
                if report.passed and report.when == "call":
                    self.passed += 1
                elif report.failed or report.skipped:
                    self.failed += 1
                    self.names.append(report.nodeid)

    counter = Count()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        pytest.main([*TOY_FILES, "-q", "-m", "not slow", "-p", "no:cacheprovider", "-W", "ignore"], plugins=[counter])
    finally:
        os.chdir(cwd)
    return {"passed": counter.passed, "total": counter.passed + counter.failed, "not_passed": counter.names}


def halo_run(optim: str, steps: int, out: Path, extra: list[str], batch: int = 2, max_length: int = 256) -> dict:
    from llmkit.cli import main

    argv = ["train", "halo", "--config", str(REPO / "recipes/configs/halo/smollm2_gsm8k_sft.yaml"),
            "--output_dir", str(out), "--max_steps", str(steps), "--max_train_samples", str(2 * steps * 2),
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
            "--max_length", str(max_length), "--max_eval_samples", "8", "--per_device_eval_batch_size", "4", "--forget_data", "",
            "--save_strategy", "no", "--eval_strategy", "no", "--logging_steps", "1", "--warmup_steps", "0",
            "--optim", optim, *extra]
    assert main(argv) == 0, f"halo run with {optim} failed"
    res = json.loads((out / "halo_results.json").read_text())
    return {"optim": optim, "extra": extra, "eval_loss": res["eval_loss"], "train_loss": res["train_loss"],
            "step_s": res["train_wall_s"] / max(res["global_step"], 1), "steps": res["global_step"]}


def vspo_run(aggregation: str, steps: int, out: Path, completion: int, batch: int, band: tuple[int, int]) -> dict:
    """VSPO's trainer on its GRPO path (mode grpo, no steering: the aggregation does not depend on it) with two
    rewards that pull apart on this model: the verbosity band ``band`` (words; brevity) and ``expertise`` (terms,
    equations, steps: longer, more formal work). The VSPO CLI offers one behaviour plus a task reward, and GSM8K
    correctness is 0 for every rollout of the bundled model at these lengths (no spread, so no signal), hence the
    trainer is built here with the recipe's own pieces and this reward pair."""
    from datasets import Dataset
    from trl import ModelConfig

    from llmkit.models import load_for_training, prepare_model_path
    from llmkit.rewards.behaviors import expertise, make_verbosity
    from llmkit.train.common import MetricsJsonlCallback
    from llmkit.train.vspo.config import VSPOConfig
    from llmkit.train.vspo.data import build_rows, load_records
    from llmkit.train.vspo.trainer import VSPOTrainer

    cfg = VSPOConfig(output_dir=str(out), mode="grpo", alpha_max=0.0, behavior="verbosity", task_reward="none",
                     verbosity_min_words=band[0], verbosity_max_words=band[1], eval_path=None,
                     reward_aggregation=aggregation, max_steps=steps, per_device_train_batch_size=batch,
                     num_generations=4, max_completion_length=completion, temperature=1.0, learning_rate=1e-5,
                     lr_scheduler_type="constant", beta=0.0, logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    funcs = [make_verbosity(*band), expertise]
    cfg.reward_weights = [1.0, 1.0]
    model, tok = load_for_training(ModelConfig(model_name_or_path=prepare_model_path("smollm2-135m-instruct", out)))
    rows = build_rows(load_records("../shared/data/gsm8k/train.jsonl", 4 * steps * batch, "train", "gsm8k", None),
                      "verbosity")
    trainer = VSPOTrainer(model=model, args=cfg, reward_funcs=funcs, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, steering_vector=None,
                          callbacks=[MetricsJsonlCallback(out / "metrics.jsonl")])
    trainer.train()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "step_time" in r]
    keep = ("rewards/", "jd/", "reward_conflict/")
    curves = {k: [r.get(k) for r in recs] for k in recs[0] if k.startswith(keep) and not k.endswith("/std")}
    times = [r["step_time"] for r in recs]
    # the first step also pays one-time costs (kernel compilation, caches): drop it when there are more
    steady = times[1:] if len(times) > 1 else times
    return {"aggregation": aggregation, "step_s": sum(steady) / len(steady), "step_times": times,
            "curves": curves, "reward": [r.get("reward") for r in recs], "band_words": list(band),
            "completion_tokens": completion, "rows_per_step": batch, "num_generations": 4}


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    halo = results["halo"]
    names = [h["label"] for h in halo]
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [h["eval_loss"] / halo[0]["eval_loss"] for h in halo], 0.4, label="eval loss")
    axes[0].bar([i + 0.2 for i in x], [h["step_s"] / halo[0]["step_s"] for h in halo], 0.4, label="step time")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_xticks(list(x), names)
    axes[0].set_ylabel("ratio to AdamW")
    axes[0].set_title(f"HALO SFT, bundled model, {halo[0]['steps']} steps")
    axes[0].legend()
    styles = {"sum": "-", "upgrad": "--"}
    for run in results["vspo"]:
        for k, v in run["curves"].items():
            steps = range(1, len(v) + 1)
            if k.startswith("rewards/") and k.endswith("/mean"):
                axes[1].plot(steps, v, styles.get(run["aggregation"], ":"), marker="o",
                             label=f"{run['aggregation']}: {k.split('/')[1]}")
            elif k.startswith("reward_conflict/") and k.endswith("/cos"):
                axes[2].plot(steps, v, styles.get(run["aggregation"], ":"), marker="o",
                             label=f"{run['aggregation']}: {k.split('/')[1].replace('__', ' vs ')}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("mean reward")
    axes[1].set_title(f"VSPO (grpo) per-reward curves; upgrad step time x{results['upgrad_step_time_ratio']:.2f}",
                      fontsize=9)
    axes[1].legend(fontsize=7)
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_ylim(-1.05, 1.05)
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("mean in-group cosine of the two rewards")
    axes[2].set_title("reward conflict (< 0: they rank rollouts oppositely)", fontsize=9)
    axes[2].legend(fontsize=7)
    from matplotlib.ticker import MaxNLocator

    for ax in axes[1:]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 HALO steps (batch 1) and 3 VSPO steps")
    ap.add_argument("--skip-toys", action="store_true", help="do not rerun the toy tests")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # quick: sized for the shared 2-core box under load (a batch-2 x 256-token step took ~170 s there)
    halo_steps, batch, max_length = (2, 1, 192) if args.quick else (10, 2, 256)
    # VSPO: 2 prompts x 4 rollouts per step, 64 new tokens (the bundled model's rollouts then run ~10-60 words, so
    # the 10-30 word band splits every group; at 32 tokens every rollout sat inside a 5-25 band: no spread)
    vspo_steps, vspo_rows, completion, band = (3, 8, 64, (10, 30)) if args.quick else (6, 8, 96, (10, 30))
    results: dict = {"quick": args.quick}

    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "optim_quick" if args.quick else "optim"
    partial = out_dir / f"{stem}.partial.json"

    def save_partial():  # a long run on a busy machine keeps what it finished
        partial.write_text(json.dumps(results, indent=2) + "\n")

    os.chdir(REPO)  # the recipes' config paths (../shared/data) are relative to the repository root
    lr = 1e-4
    runs = [("AdamW", "adamw_torch", []),
            ("Muon", "llmkit_muon", ["--optim_args", "adjust_lr_fn=match_rms_adamw"]),
            ("Lion", "llmkit_lion", ["--llmkit_lr", str(lr / 3)])]
    with tempfile.TemporaryDirectory(prefix="bench_optim_") as tmp:
        halo = []
        for label, optim, extra in runs:
            r = halo_run(optim, halo_steps, Path(tmp) / f"halo_{optim}", extra + ["--learning_rate", str(lr)],
                         batch=batch, max_length=max_length)
            r["label"] = label
            halo.append(r)
            results["halo"] = halo
            save_partial()
            print(f"halo {label}: eval_loss {r['eval_loss']:.4f}, step {r['step_s']:.1f}s", flush=True)
        results["halo"] = halo
        base = halo[0]
        for r in halo[1:]:
            key = r["label"].lower()
            results[f"{key}_vs_adamw_eval_loss_ratio"] = r["eval_loss"] / base["eval_loss"]
            results[f"{key}_vs_adamw_step_time_ratio"] = r["step_s"] / base["step_s"]
            print(f"{key}_vs_adamw_eval_loss_ratio: {results[f'{key}_vs_adamw_eval_loss_ratio']:.4f}")
            print(f"{key}_vs_adamw_step_time_ratio: {results[f'{key}_vs_adamw_step_time_ratio']:.3f}")

        vspo = []
        for agg in ("sum", "upgrad"):
            vspo.append(vspo_run(agg, vspo_steps, Path(tmp) / f"vspo_{agg}", completion, vspo_rows, band))
            results["vspo"] = vspo
            save_partial()
        results["upgrad_step_time_ratio"] = vspo[1]["step_s"] / vspo[0]["step_s"]
        for key in ("reward_means", "reward_group_spread", "reward_conflict_cos", "reward_conflict_frac_opposed"):
            results[key] = {}
        for run in vspo:
            agg, c = run["aggregation"], run["curves"]
            means = {k.split("/")[1]: [round(x, 4) for x in v] for k, v in c.items()
                     if k.startswith("rewards/") and k.endswith("/mean")}
            results["reward_means"][agg] = means
            # every step has the same number of groups: the mean over steps is the fraction over all groups
            results["reward_group_spread"][agg] = {k.split("/")[1]: round(sum(v) / len(v), 4) for k, v in c.items()
                                                   if k.endswith("/group_spread")}
            for key, suffix in (("reward_conflict_cos", "/cos"), ("reward_conflict_frac_opposed", "/frac_opposed")):
                vals = [sum(v) / len(v) for k, v in c.items() if k.startswith("reward_conflict/") and k.endswith(suffix)]
                results[key][agg] = round(vals[0], 4) if len(vals) == 1 else None
            print(f"vspo {agg}: step {run['step_s']:.1f}s, per-reward means by step {means}")
            print(f"vspo {agg}: fraction of groups with reward spread {results['reward_group_spread'][agg]}, "
                  f"mean in-group reward cosine {results['reward_conflict_cos'][agg]}, "
                  f"fraction of groups opposed {results['reward_conflict_frac_opposed'][agg]}")
            weights = {k.split("/")[2]: [round(x, 3) for x in v] for k, v in c.items() if k.startswith("jd/weight/")}
            if weights:
                print(f"vspo {agg}: UPGrad weights by step {weights}")
        print(f"upgrad_step_time_ratio: {results['upgrad_step_time_ratio']:.3f}")
        save_partial()

    if not args.skip_toys:
        t0 = time.time()
        toys = run_toys()
        results["toys"] = toys
        print(f"toy tests passed: {toys['passed']}/{toys['total']} ({time.time() - t0:.0f}s)", flush=True)
    partial.unlink(missing_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out_dir / f"{stem}.png")
    print(f"results: {out_dir / (stem + '.json')}, plot: {out_dir / (stem + '.png')}")
    summary = {k: results.get(k) for k in ("muon_vs_adamw_eval_loss_ratio", "lion_vs_adamw_eval_loss_ratio",
                                           "upgrad_step_time_ratio", "muon_vs_adamw_step_time_ratio",
                                           "lion_vs_adamw_step_time_ratio")}
    for key in ("reward_means", "reward_group_spread", "reward_conflict_cos", "reward_conflict_frac_opposed"):
        summary[key] = results.get(key)
    summary["toy_tests_passed"] = results.get("toys", {}).get("passed")
    summary["toy_tests_total"] = results.get("toys", {}).get("total")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
