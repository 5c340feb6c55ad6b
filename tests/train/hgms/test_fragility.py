"""HG-MS's weights on a three-source mixture with one corrupted source, at the smoke config's settings
(a random 2-layer Llama, full finetuning at lr 1e-3, a weight update every step, 40 steps, 8 rows per
source): far from any inner minimizer, where the hypergradient's assumptions fail. Without the trust
rule this run (seed 1) gave the corrupted source the largest weight (about 0.8 of 1); the rule must
refuse or damp the updates so that it does not."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_corrupted_source_does_not_get_the_largest_weight_at_the_smoke_settings(repo_root, tmp_path, shared_data):
    from llmkit.commands.train import parse_method_args
    from llmkit.train.common import load_records
    from llmkit.train.hgms.mixtures import random_word_answers, write_jsonl

    gsm8k = shared_data / "gsm8k" / "train.jsonl"
    rows = load_records(str(gsm8k), limit=16)
    corrupt = write_jsonl(random_word_answers(rows[8:16], seed=0), tmp_path / "corrupt.jsonl")
    out = tmp_path / "out"
    module, configs = parse_method_args("hgms", [
        "--config", str(repo_root / "recipes/configs/hgms/tiny_cpu.yaml"),
        "--sources", f"gsm8k={gsm8k}", f"math={shared_data / 'math500' / 'test.jsonl'}", f"corrupt={corrupt}",
        "--target_data", str(shared_data / "gsm8k" / "test.jsonl"), "--max_steps", "40", "--seed", "1",
        "--save_strategy", "no", "--logging_steps", "10", "--disable_tqdm", "true", "--output_dir", str(out)])
    args, train, _ = configs
    assert (args.weighting, args.weights_update_interval, train.learning_rate, args.max_samples_per_source,
            args.hgms_trust) == ("hgms", 1, 1e-3, 8, True)
    assert module.main(*configs) == 0
    res = json.loads((out / "hgms_results.json").read_text())
    w = res["final_weights"]
    assert res["weight_updates"] == 40 and res["weight_refusals"] > 0
    assert w["corrupt"] <= max(w["gsm8k"], w["math"]) + 1e-9, w
    assert w["corrupt"] <= 1 / 3 + 0.02, w
