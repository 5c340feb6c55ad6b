"""Optimization backends, part 3: LOCU, TC-DRO, noiseless inverse optimization, rank-one tensor recovery on the
Segre manifold, matrix completion by nullspace perturbation. Each figure is measured against its anchor in the
same run (a reward penalty, ERM / global chi-square DRO, the d/T rate, RGD, the perturbation size eps).

Figures:
- LOCU on the softmax CMDP toy from infeasible starts: fraction of seeds feasible at the end (``locu_feasible_rate``)
  beside a fixed reward penalty; steps from near-collinear constraints (LOCU vs naive projection, step / radius).
- TC-DRO: tail MSE ratio vs ERM and vs global chi-square DRO on the imbalanced toy, on scikit-learn's bundled
  diabetes data, and in the GSM8K difficulty regressor (``llmkit.train.difficulty``).
- Inverse optimization: held-out decision error vs T (slope of log error on log T); reward weights recovered from
  simulated preference pairs (cosine with the planted weights, held-out pair agreement vs uniform weights).
- Tensor: iterations to the noise floor, RGN / RGD.  Matrix completion: relative error vs eps.
- VSPO on the bundled model with "mean completion words <= L": LOCU (``reward_aggregation: locu``) beside a
  length-penalty reward, same step budget: constraint satisfaction rate over the steps
  (``vspo_locu_constraint_satisfaction``, ``vspo_penalty_constraint_satisfaction``), mean words per step, final
  task reward.
- ``toy_tests_passed`` / ``toy_tests_total``: the five backends' test files, run by pytest.

The figures are computed in ``llmkit.experiments.optim_structured``.

    .venv/bin/python bench/optim_structured.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmkit.experiments import optim_structured as OS
from llmkit.experiments.harness import write_json
from llmkit.experiments.optim import find_test_files, run_test_files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
VSPO_CONFIG = ROOT / "recipes" / "configs" / "vspo" / "smollm2_verbosity_gsm8k.yaml"
TESTS = ("constrained", "dro", "inverse", "tensor", "matrix")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer seeds and sizes")
    args = ap.parse_args()
    torch.set_num_threads(1)   # small dense algebra; avoids OpenMP spin-waits on a shared machine
    t0 = time.time()
    res = OS.figures(args.quick, GSM8K, VSPO_CONFIG)
    toys = run_test_files(ROOT, find_test_files(ROOT, TESTS))
    res["toy_tests_passed"], res["toy_tests_total"] = toys["passed"], toys["total"]
    print(f"toy tests: {res['toy_tests_passed']} / {res['toy_tests_total']} passed")
    res["seconds"] = time.time() - t0
    name = "optim_structured_quick" if args.quick else "optim_structured"
    write_json(RESULTS / f"{name}.json", json.loads(json.dumps(res, default=str)))
    OS.plot(res, RESULTS / f"{name}.png")
    print(json.dumps({k: res.get(k) for k in OS.SUMMARY_KEYS}))


if __name__ == "__main__":
    main()
