"""KV-cache measurement helpers (llmkit.serving.kv_cache.evaluate) on tiny models."""

from __future__ import annotations

import pytest
import torch

from llmkit.serving.kv_cache import InQuantCache, KIVICache, default_calibration_path
from llmkit.serving.kv_cache import evaluate as kve


@torch.inference_mode()
def test_nll_through_caches_matches_a_plain_forward_for_the_unquantized_cache(tiny_model):
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    ctx, tgt = ids[:, :30], ids[:, 30:]
    res = kve.nll_through_caches(tiny_model, ctx, tgt, {"bf16": None, "kivi": lambda: KIVICache(tiny_model.config,
                                                                                                group_size=8)})
    logits = tiny_model(ids).logits[0, 29:-1].float()
    want = torch.nn.functional.cross_entropy(logits, tgt[0], reduction="sum").item()
    assert res["bf16"][1] == 10 and res["bf16"][0] == pytest.approx(want, rel=1e-4)
    assert res["kivi"][0] != res["bf16"][0]  # the quantized past is really read
    with pytest.raises(ValueError, match=r"must be \[1, n\]"):
        kve.nll_through_caches(tiny_model, ids[0], tgt, {"bf16": None})


@torch.inference_mode()
def test_bytes_per_token_and_capacity(tiny_model):
    ids = torch.randint(3, 100, (1, 64))
    bf16 = kve.bf16_bytes_per_token(tiny_model.config)
    assert bf16 == 2 * 2 * 2 * 2 * 16  # K+V, 2 bytes, 2 layers, 2 kv-heads, head_dim 16
    tok = kve.bytes_per_token(tiny_model, lambda: InQuantCache(tiny_model.config, layout="per-token", n_outliers=0), ids)
    # per token and kv-head: 8 packed bytes + bf16 scale and zero; no window
    assert tok["held"] == 2 * 2 * 2 * (8 + 4) and tok["window_bytes"] == 0
    via_kv = kve.bytes_per_token(tiny_model, lambda: InQuantCache(tiny_model.config, layout="per-token", n_outliers=0),
                                 kv=kve.prefill_kv(tiny_model, ids))
    assert via_kv == tok  # writing a prefill's keys/values holds what the prefill itself stores
    ch = kve.bytes_per_token(tiny_model, lambda: InQuantCache(tiny_model.config, group_size=32, n_outliers=0), ids)
    assert ch["window_bytes"] == 31 * bf16
    assert kve.capacity(tok["held"], 2**20, 1024) == 2**20 // (tok["held"] * 1024)
    assert kve.capacity(ch["held"], 2**20, 1024, ch["window_bytes"]) == 2**20 // (ch["held"] * 1024 + 31 * bf16)
    assert kve.capacity(bf16, 2**20, 1024) * 2 < kve.capacity(tok["held"], 2**20, 1024)
    with pytest.raises(ValueError, match="positive"):
        kve.capacity(0, 2**20, 10)


def test_long_context_text_is_long_enough(tiny_tokenizer, shared_data):
    text = kve.long_context_text(shared_data / "math500" / "test.jsonl", tiny_tokenizer, min_tokens=2304)
    assert len(tiny_tokenizer(text, add_special_tokens=False).input_ids) >= 2304
    assert text.startswith("Problem: ") and "\nSolution: " in text
    with pytest.raises(FileNotFoundError, match="MATH-500 file not found"):
        kve.long_context_text(shared_data / "nope.jsonl", tiny_tokenizer)


def test_calibration_file_lives_in_a_subfolder_of_a_local_model(tmp_path, tiny_model, monkeypatch):
    tiny_model.config._name_or_path = str(tmp_path)
    assert default_calibration_path(tiny_model) == tmp_path / "kv_cache" / "inquant_calibration.safetensors"
    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path / "home"))
    tiny_model.config._name_or_path = "org/some-model"
    assert default_calibration_path(tiny_model) == tmp_path / "home" / "kv_calibration" / "org--some-model.safetensors"


def test_served_throughput_caps_concurrent_rows(tiny_model, tiny_tokenizer):
    prompts = ["hi", "a longer prompt", "third one", "four"]
    r = kve.served_throughput(tiny_model, tiny_tokenizer, prompts, 6, max_batch_size=2)
    assert 0 < r["tokens"] <= 4 * 6 and r["tokens_per_s"] > 0
    assert r["max_batch_seen"] <= 2
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        kve.served_throughput(tiny_model, tiny_tokenizer, prompts, 6, max_batch_size=0)


def test_plot_results_writes_a_png_and_needs_the_arms(tmp_path):
    per_arm = {a: {"pairs": p, "possible": 8} for a, p in (("inquant/per-token/none", 0), ("inquant/per-token/score", 3))}
    res = {"arms": {"per_arm": per_arm, "ppl": {"bf16": 2.0, "inquant/per-token/none": 2.1, "inquant/per-token/score": 2.02},
                    "long_ppl": {"bf16": 3.0, "inquant/per-token/none": 3.3, "inquant/per-token/score": 3.1}},
           "perplexity": {"bf16": 2.0, "kivi": 2.05, "tokens": 10},
           "capacity": {"sequences": {"bf16": 10, "inquant": 35}},
           "served": {"results": {"bf16": {"tokens_per_s": 2.0}, "inquant": {"tokens_per_s": 3.0}}}}
    out = kve.plot_results(res, tmp_path / "kv.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no 'arms'"):
        kve.plot_results({}, tmp_path / "x.png")
