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
   summed rewards (anchor) and ``reward_aggregation: upgrad``: per-reward curves and the step-time ratio.

    .venv/bin/python bench/optim.py --quick    # 2 HALO steps (batch 1), 2 VSPO steps, small eval
    .venv/bin/python bench/optim.py            # 10 HALO steps, 4 VSPO steps

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


def vspo_run(aggregation: str, steps: int, out: Path, completion: int = 48) -> dict:
    from llmkit.cli import main

    argv = ["train", "vspo", "--config", str(REPO / "recipes/configs/vspo/smollm2_verbosity_gsm8k.yaml"),
            "--output_dir", str(out), "--mode", "grpo", "--max_steps", str(steps), "--dataset_limit", "16",
            "--eval_path", "", "--per_device_train_batch_size", "4", "--num_generations", "4",
            "--max_completion_length", str(completion), "--save_strategy", "no", "--reward_aggregation", aggregation,
            "--verbosity_min_words", "5", "--verbosity_max_words", "25"]
    assert main(argv) == 0, f"vspo run with {aggregation} failed"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "step_time" in r]
    curves = {k: [r[k] for r in recs] for k in recs[0] if k.startswith(("rewards/", "jd/")) and k.endswith(
        ("/mean", "")) and not k.endswith("/std")} if recs else {}
    times = [r["step_time"] for r in recs]
    # the first step also pays one-time costs (compilation of the kernels, caches): drop it when there are more
    steady = times[1:] if len(times) > 1 else times
    return {"aggregation": aggregation, "step_s": sum(steady) / len(steady), "step_times": times,
            "curves": curves, "reward": [r.get("reward") for r in recs]}


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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
    for run in results["vspo"]:
        for k, v in run["curves"].items():
            if k.startswith("rewards/") and k.endswith("/mean"):
                axes[1].plot(range(1, len(v) + 1), v, marker="o",
                             label=f"{run['aggregation']}: {k.split('/')[1]}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("mean reward")
    axes[1].set_title(f"VSPO (grpo) per-reward curves; upgrad step time x{results['upgrad_step_time_ratio']:.2f}")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 HALO steps (batch 1) and 2 VSPO steps")
    ap.add_argument("--skip-toys", action="store_true", help="do not rerun the toy tests")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # quick: sized for the shared 2-core box under load (a batch-2 x 256-token step took ~170 s there)
    halo_steps, vspo_steps, batch, max_length, completion = (2, 2, 1, 192, 32) if args.quick else (10, 4, 2, 256, 48)
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
            vspo.append(vspo_run(agg, vspo_steps, Path(tmp) / f"vspo_{agg}", completion=completion))
            results["vspo"] = vspo
            save_partial()
        results["upgrad_step_time_ratio"] = vspo[1]["step_s"] / vspo[0]["step_s"]
        for run in vspo:
            per = {k.split("/")[1]: [round(x, 3) for x in v] for k, v in run["curves"].items()
                   if k.startswith("rewards/") and k.endswith("/mean")}
            print(f"vspo {run['aggregation']}: step {run['step_s']:.1f}s, per-reward means by step {per}")
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
    summary["toy_tests_passed"] = results.get("toys", {}).get("passed")
    summary["toy_tests_total"] = results.get("toys", {}).get("total")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
