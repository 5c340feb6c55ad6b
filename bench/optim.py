"""Optimization backends, part 1: toy settings, optimizers in the HALO recipe, Jacobian descent in VSPO.

Three figures, each measured against its anchor in the same run:

1. Toy settings: the seed papers' toy problems are the tests in tests/test_optim_{sign,muon,imuon,mirror,ssn,jd,zo}.py
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
bench/results/optim[_quick].json and .png. Each finished run is kept in bench/results/optim[_quick]_parts/
until the whole bench is done: rerunning the same command after a crash continues from there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from llmkit.experiments import optim as O
from llmkit.experiments.harness import ResultStore, write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
HALO_CONFIG = REPO / "recipes" / "configs" / "halo" / "smollm2_gsm8k_sft.yaml"
GSM8K_TRAIN = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
TOYS = ("sign", "muon", "imuon", "mirror", "ssn", "jd", "zo")


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
    lr = 1e-4
    stem = "optim_quick" if args.quick else "optim"
    store = ResultStore(RESULTS / f"{stem}_parts", {"halo": [halo_steps, batch, max_length, lr],
                                                    "vspo": [vspo_steps, vspo_rows, completion, list(band)]})
    results: dict = {"quick": args.quick}
    os.chdir(REPO)  # the recipes' config paths (../shared/data) are relative to the repository root
    runs = [("AdamW", "adamw_torch", []),
            ("Muon", "llmkit_muon", ["--optim_args", "adjust_lr_fn=match_rms_adamw"]),
            ("Lion", "llmkit_lion", ["--llmkit_lr", str(lr / 3)])]
    with tempfile.TemporaryDirectory(prefix="bench_optim_") as tmp:
        halo = []
        for label, optim, extra in runs:
            r = store.memo(f"halo_{optim}", lambda optim=optim, extra=extra: O.halo_run(
                HALO_CONFIG, optim, halo_steps, Path(tmp) / f"halo_{optim}", extra + ["--learning_rate", str(lr)],
                batch=batch, max_length=max_length))
            halo.append({**r, "label": label})
            print(f"halo {label}: eval_loss {r['eval_loss']:.4f}, step {r['step_s']:.1f}s", flush=True)
        results["halo"] = halo
        results.update(ratios := O.halo_ratios(halo))
        for k, v in ratios.items():
            print(f"{k}: {v:.4f}" if "eval_loss" in k else f"{k}: {v:.3f}")
        vspo = [store.memo(f"vspo_{agg}", lambda agg=agg: O.vspo_run(
                    agg, vspo_steps, Path(tmp) / f"vspo_{agg}", completion, vspo_rows, band, GSM8K_TRAIN))
                for agg in ("sum", "upgrad")]
    results["vspo"] = vspo
    results.update(O.vspo_summary(vspo))
    for run in vspo:
        agg = run["aggregation"]
        print(f"vspo {agg}: step {run['step_s']:.1f}s, per-reward means by step {results['reward_means'][agg]}")
        print(f"vspo {agg}: fraction of groups with reward spread {results['reward_group_spread'][agg]}, "
              f"mean in-group reward cosine {results['reward_conflict_cos'][agg]}, "
              f"fraction of groups opposed {results['reward_conflict_frac_opposed'][agg]}")
        if weights := O.upgrad_weights(run["curves"]):
            print(f"vspo {agg}: UPGrad weights by step {weights}")
    print(f"upgrad_step_time_ratio: {results['upgrad_step_time_ratio']:.3f}")

    if not args.skip_toys:
        t0 = time.time()
        results["toys"] = toys = O.run_test_files(REPO, O.find_test_files(REPO, TOYS), marker="not slow")
        print(f"toy tests passed: {toys['passed']}/{toys['total']} ({time.time() - t0:.0f}s)", flush=True)
    write_json(RESULTS / f"{stem}.json", results)
    O.plot(results, RESULTS / f"{stem}.png")
    shutil.rmtree(store.root, ignore_errors=True)  # the whole run is saved: its parts are not needed any more
    print(f"results: {RESULTS / (stem + '.json')}, plot: {RESULTS / (stem + '.png')}")
    print(json.dumps(O.summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
