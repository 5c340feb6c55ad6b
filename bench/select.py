"""Few-evaluation selection and tuning: the four optimization backends in their papers' settings, and
``llmkit select`` on the bundled model.

Figures (ratios / rates measured in the same run):
- tci_correct_rate: beta-EB-TCI (delta = 0.1) right on a Bernoulli instance with a unique best arm;
  tci_samples_vs_uniform: its mean stopping time / uniform allocation's with the same GLR stopping rule;
  tci_tau_vs_tstar_log: mean stopping time / (T*_beta(mu) log(1/delta)) at delta = 1e-3 and 1e-12.
- bisection_success_rate: localize_minimizer within eps on four noisy convex functions.
- es_sphere_success_rate: truncated Riemannian (1+1)-ES reaches |<x, u1>| >= 0.95 on sparse PCA over
  S^99 within 2000 evaluations (success fixed before the run; Euclidean ES projected back and CMA-ES at the
  same budget, sigma0 and starts beside it); es_sphere_evals_vs_euclidean / _vs_cma: median evaluations
  to that success, Riemannian / baseline (quartiles in es_sphere_evals_quartiles). es_stiefel_*: the same
  for 12-component sparse PCA over St(20, 12) (subspace overlap >= 0.95 within 3000), where 78 of the 240
  ambient directions are normal to the manifold; on the sphere only 1 of n is, so there the paper's
  d-vs-n advantage is a factor 1 - 1/n and the ratio is expected near 1 (see llmkit/optim/es.py).
  es_ratio_by_normal_share: that ratio on more spheres / Stiefel manifolds against 1 - d/n (plotted).
- bts_vs_random_regret_ratio: median simple regret of GP batched Thompson sampling (batches of 4) /
  random search, equal evaluations, Branin and Hartmann-3 (geometric mean of the two ratios).
- select_evals_vs_full: ``llmkit.selection.select_best`` (what ``llmkit select`` runs) over three
  generation settings of the bundled model on a GSM8K-derived one-step arithmetic subset (the
  construction of bench/ldp_cache.py, on which the model is not at 0%), graded by the GSM8K grader: each
  arm's answer to every problem is generated once (that is the full evaluation), then the top-two rule is
  run over seeds reading those answers through ``llmkit.selection.TableScorer``, which spends them the way
  the CLI's ``EngineScorer`` does: a miss generates that problem and the arm's next upcoming ones together,
  ``--batch-size`` (= lookahead, CLI default 8; ``select_lookahead`` in the JSON) at most, and every answer
  so generated counts as spent. The ratio is those answers / all of them (what ``llmkit select
  --batch-size 8`` would have generated); ``select_evals_vs_full_no_lookahead`` is the same runs counting
  only the answers the rule actually read (``--batch-size 1``). select_winner_match_rate says how often it
  named the full evaluation's winner.

The figures are computed in ``llmkit.experiments.selection``.

    .venv/bin/python bench/select.py [--quick] [--skip-model] [--only es,bo]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the stdlib's `select` module (the issue fixes the name). Run as a script, keep its
# folder off the import path. Run as any other bench script, that folder is sys.path[0] and `import select`
# (subprocess, selectors, asyncio ...) lands here: hand the importer the real module instead.
_HERE = Path(__file__).resolve().parent
if __name__ == "select":
    # (the rest of this file still runs as a throwaway module: only imports and definitions, cheap)
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
    del sys.modules["select"]
    try:
        import select as _real  # the stdlib's (lib-dynload)
    finally:
        sys.path[:] = _saved
    sys.modules["select"] = _real
else:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse
import json

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-model", action="store_true", help="no bundled-model run (select figure left out)")
    ap.add_argument("--problems", type=int, default=None, help="problems in the select pool")
    ap.add_argument("--only", default=None,
                    help="comma list of parts to run (bandits,bisection,es,bo,select), for iteration: prints the "
                         "figures but writes no result files (the committed JSON is always a complete run)")
    args = ap.parse_args()
    # imported here, not above: when this file stands in for the stdlib's `select` (see the top), a module-level
    # import of llmkit would run inside that half-finished import of selectors/subprocess and break it
    from llmkit.experiments import selection as S
    from llmkit.experiments.harness import write_json

    q = args.quick
    parts = {*S.PARTS, "select"}
    only = set(args.only.split(",")) if args.only else parts
    if only - parts:
        ap.error(f"--only: unknown part(s) {sorted(only - parts)}; choose from {sorted(parts)}")
    res = {"quick": q, **S.run_parts(only, q)}
    if not args.skip_model and "select" in only:
        res.update(S.select_figures(GSM8K_TRAIN, args.problems or (30 if q else 60), 20))
        print(f"select: evals_vs_full={res['select_evals_vs_full']:.3f} (CLI lookahead/batch "
              f"{res['select_lookahead']}; {res['select_evals_vs_full_no_lookahead']:.3f} counting only answers "
              f"read), winner match "
              f"{res['select_winner_match_rate']:.2f}, full accuracies {res['select_full_accuracy']}", flush=True)
    else:
        res["select_evals_vs_full"] = None
    if args.only:
        print(json.dumps(S.summary(res)))
        return
    path = RESULTS / ("select_quick.json" if q else "select.json")
    write_json(path, res)
    try:
        S.plot(res, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 - the figures are written; a plot problem must not hide them
        print(f"plot skipped: {e}", file=sys.stderr)
    print(json.dumps(S.summary(res)))


if __name__ == "__main__":
    main()
