"""Optimization backends in the recipes (bench/optim.py): Muon and Lion against AdamW in HALO's SFT, UPGrad
against summed rewards in VSPO's GRPO path, and the backends' toy tests counted.

:func:`halo_run` runs ``llmkit train halo`` as a user does; :func:`vspo_run` builds VSPO's trainer from the
recipe's pieces with two rewards that conflict on the bundled model; :func:`halo_ratios` and
:func:`vspo_summary` turn the runs into the figures; :func:`run_test_files` counts passing tests (also used by
bench/optim_structured.py). Results: bench/results/optim*.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REWARD_KEYS = ("reward_means", "reward_group_spread", "reward_conflict_cos", "reward_conflict_frac_opposed")
SUMMARY_KEYS = ("muon_vs_adamw_eval_loss_ratio", "lion_vs_adamw_eval_loss_ratio", "upgrad_step_time_ratio",
                "muon_vs_adamw_step_time_ratio", "lion_vs_adamw_step_time_ratio")


def find_test_files(root: str | Path, names, prefix: str = "test_optim_") -> list[str]:
    """``tests/<prefix><name>.py`` for each name, or wherever under tests/ a file of that name lives now."""
    root, out = Path(root), []
    for n in names:
        name = f"{prefix}{n}.py"
        found = [root / "tests" / name] if (root / "tests" / name).is_file() else sorted((root / "tests").rglob(name))
        if not found:
            raise FileNotFoundError(f"no test file {name} under {root / 'tests'}")
        out.append(str(found[0].relative_to(root)))
    return out


def run_test_files(root: str | Path, files: list[str], marker: str | None = None, timeout: float = 3600) -> dict:
    """Run pytest on ``files`` in a subprocess (cwd ``root``); ``{passed, total, not_passed}`` from its JUnit
    report. A skipped, failed or erroring test counts in ``total`` and is named in ``not_passed``."""
    with tempfile.TemporaryDirectory(prefix="bench-tests-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-W", "ignore",
               f"--junitxml={xml}", *(["-m", marker] if marker else [])]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False)
        if not xml.is_file():
            raise RuntimeError(f"pytest wrote no report ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        cases = ET.parse(xml).getroot().iter("testcase")
        passed, not_passed = 0, []
        for c in cases:
            if any(c.find(tag) is not None for tag in ("failure", "error", "skipped")):
                not_passed.append(f"{c.get('classname', '')}::{c.get('name')}")
            else:
                passed += 1
    return {"passed": passed, "total": passed + len(not_passed), "not_passed": not_passed}


def halo_run(config: str | Path, optim: str, steps: int, out: Path, extra: list[str], batch: int = 2,
             max_length: int = 256) -> dict:
    """``llmkit train halo --config <config>`` shortened to ``steps`` with optimizer ``optim``; eval and train
    loss and seconds per step from its results file."""
    from llmkit.cli import main

    argv = ["train", "halo", "--config", str(config),
            "--output_dir", str(out), "--max_steps", str(steps), "--max_train_samples", str(2 * steps * 2),
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
            "--max_length", str(max_length), "--max_eval_samples", "8", "--per_device_eval_batch_size", "4",
            "--forget_data", "", "--save_strategy", "no", "--eval_strategy", "no", "--logging_steps", "1",
            "--warmup_steps", "0", "--optim", optim, *extra]
    if main(argv) != 0:
        raise RuntimeError(f"halo run with {optim} failed")
    res = json.loads((out / "halo_results.json").read_text())
    return {"optim": optim, "extra": extra, "eval_loss": res["eval_loss"], "train_loss": res["train_loss"],
            "step_s": res["train_wall_s"] / max(res["global_step"], 1), "steps": res["global_step"]}


def metric_curves(recs: list[dict], prefixes=("rewards/", "jd/", "reward_conflict/")) -> dict:
    """Per-step series of the logged metrics under ``prefixes`` (``*/std`` left out)."""
    return {k: [r.get(k) for r in recs] for k in recs[0] if k.startswith(prefixes) and not k.endswith("/std")}


def vspo_run(aggregation: str, steps: int, out: Path, completion: int, batch: int, band: tuple[int, int],
             data: str | Path) -> dict:
    """VSPO's trainer on its GRPO path (mode grpo, no steering: the aggregation does not depend on it) with two
    rewards that pull apart on this model: the verbosity band ``band`` (words; brevity) and ``expertise`` (terms,
    equations, steps: longer, more formal work). The VSPO CLI offers one behaviour plus a task reward, and GSM8K
    correctness is 0 for every rollout of the bundled model at these lengths (no spread, so no signal), hence the
    trainer is built here with the recipe's own pieces and this reward pair. ``data``: GSM8K train JSONL."""
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
    rows = build_rows(load_records(str(data), 4 * steps * batch, "train", "gsm8k", None), "verbosity")
    trainer = VSPOTrainer(model=model, args=cfg, reward_funcs=funcs, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, steering_vector=None,
                          callbacks=[MetricsJsonlCallback(out / "metrics.jsonl")])
    trainer.train()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "step_time" in r]
    times = [r["step_time"] for r in recs]
    # the first step also pays one-time costs (kernel compilation, caches): drop it when there are more
    steady = times[1:] if len(times) > 1 else times
    return {"aggregation": aggregation, "step_s": sum(steady) / len(steady), "step_times": times,
            "curves": metric_curves(recs), "reward": [r.get("reward") for r in recs], "band_words": list(band),
            "completion_tokens": completion, "rows_per_step": batch, "num_generations": 4}


def halo_ratios(halo: list[dict]) -> dict:
    """``<label>_vs_adamw_eval_loss_ratio`` / ``_step_time_ratio`` for every run after the first (AdamW)."""
    base, out = halo[0], {}
    for r in halo[1:]:
        key = r["label"].lower()
        out[f"{key}_vs_adamw_eval_loss_ratio"] = r["eval_loss"] / base["eval_loss"]
        out[f"{key}_vs_adamw_step_time_ratio"] = r["step_s"] / base["step_s"]
    return out


def vspo_summary(vspo: list[dict]) -> dict:
    """From the ``sum`` and ``upgrad`` runs: the step-time ratio, per-reward means by step, the fraction of groups
    where each reward spreads, and the mean in-group cosine / fraction opposed of the two rewards."""
    out: dict = {"upgrad_step_time_ratio": vspo[1]["step_s"] / vspo[0]["step_s"], **{k: {} for k in REWARD_KEYS}}
    for run in vspo:
        agg, c = run["aggregation"], run["curves"]
        out["reward_means"][agg] = {k.split("/")[1]: [round(x, 4) for x in v] for k, v in c.items()
                                    if k.startswith("rewards/") and k.endswith("/mean")}
        # every step has the same number of groups: the mean over steps is the fraction over all groups
        out["reward_group_spread"][agg] = {k.split("/")[1]: round(sum(v) / len(v), 4) for k, v in c.items()
                                           if k.endswith("/group_spread")}
        for key, suffix in (("reward_conflict_cos", "/cos"), ("reward_conflict_frac_opposed", "/frac_opposed")):
            vals = [sum(v) / len(v) for k, v in c.items() if k.startswith("reward_conflict/") and k.endswith(suffix)]
            out[key][agg] = round(vals[0], 4) if len(vals) == 1 else None
    return out


def upgrad_weights(curves: dict) -> dict:
    return {k.split("/")[2]: [round(x, 3) for x in v] for k, v in curves.items() if k.startswith("jd/weight/")}


def summary(results: dict) -> dict:
    """bench/optim.py's last stdout line."""
    out = {k: results.get(k) for k in SUMMARY_KEYS} | {k: results.get(k) for k in REWARD_KEYS}
    out["toy_tests_passed"] = results.get("toys", {}).get("passed")
    out["toy_tests_total"] = results.get("toys", {}).get("total")
    return out


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    for ax in axes[1:]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
