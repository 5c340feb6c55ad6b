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
    .venv/bin/python bench/hgms.py             # FULL: 60 steps x 4 examples x 128 tokens, an update every 6, 3 seeds

FULL is sized for these 2 CPU cores (its 15 runs fit an afternoon split over two processes with ``--methods``);
each run's seconds per step and seconds spent on weight updates are in hgms.json (``s_per_step``,
``weighting_s``) and on bench/results/hgms.md.

Every figure is a mean over training seeds with a 95% t-interval (``<key>_ci``); differences to
uniform are paired by seed (``heldout_loss_diff_<method>_vs_uniform``).

Each run is saved to ``bench/results/hgms_parts/<name>/<method>-s<seed>.json`` as it finishes, with the
configuration; a rerun of the same command skips saved runs (``--fresh`` retrains), so the FULL preset can
be split over processes with ``--methods`` (and ``--train-seeds``) and over sessions. DoReMi reuses the uniform run's model from
``--work`` when it is there (same machine), else trains its own uniform reference first.

Writes bench/results/hgms[_quick].json and .png (weight of the noisy source over steps per method;
held-out losses per method).
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "bench" / "results"


def parse_args():
    from llmkit.experiments.harness import preset_parser
    from llmkit.experiments.hgms import FULL, METHODS, QUICK

    p = preset_parser(__doc__, FULL, QUICK, "smoke run (preset QUICK)",
                      choices={"corruption": ["random_words", "shuffled"]})
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="methods to train in this invocation; the others come from saved runs (split the "
                   "comparison over processes: --methods uniform doremi, --methods hgms, --methods doge odm)")
    p.add_argument("--train-seeds", nargs="+", type=int, default=None, metavar="SEED",
                   help="seeds to train in this invocation (default: all of the preset's); with --methods this "
                   "splits one method's seeds over processes, e.g. --methods hgms --train-seeds 0 2")
    p.add_argument("--fresh", action="store_true", help="retrain runs that have saved parts")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    p.add_argument("--work", default=str(REPO / "outputs" / "hgms-bench"), help="scratch folder (data, models)")
    return p.parse_args()


def main() -> None:
    import torch

    from llmkit.experiments import hgms as H
    from llmkit.experiments.harness import ResultStore, resolve_preset

    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = resolve_preset(H.FULL, H.QUICK, args.quick, args)
    bad = [s for s in args.train_seeds or () if not 0 <= s < cfg["seeds"]]
    if bad:
        raise SystemExit(f"--train-seeds {bad}: the preset has seeds 0..{cfg['seeds'] - 1}")
    work = Path(args.work) / ("quick" if args.quick else "full")
    files, heldout = H.build_data(cfg, DATA, work)
    name = "hgms_quick" if args.quick else "hgms"
    store = ResultStore(RESULTS / "hgms_parts" / name, cfg, fresh=args.fresh)
    runs = H.run_all(cfg, H.METHODS, files, work, heldout, gsm8k_test=DATA / "gsm8k" / "test.jsonl", store=store,
                     train=args.methods, train_seeds=args.train_seeds)
    missing = H.missing_runs(runs, cfg)
    if missing:
        print(f"saved {len(runs) * cfg['seeds'] - len(missing)} runs under {store.root}; the summary still needs "
              f"{', '.join(missing)} (run the same command with --methods / --train-seeds naming them)", flush=True)
        return
    summary = H.summarize(runs, cfg)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"config": cfg, "summary": summary, "methods": runs},
                                                     indent=1) + "\n")
    H.plot(runs, summary, RESULTS / f"{name}.png", f"SmolLM2-135M LoRA, {cfg['steps']} steps x {cfg['batch']} "
           f"examples x <= {cfg['max_length']} tokens, {cfg['seeds']} seeds")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
