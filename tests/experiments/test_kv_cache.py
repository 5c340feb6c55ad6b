"""The KV-cache benchmark's code (llmkit.experiments.kv_cache) on tiny models: measuring through caches,
the sections, the figures, resumable parts and their merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmkit.experiments import kv_cache as kve
from llmkit.experiments.harness import ResultStore
from llmkit.serving.kv_cache import InQuantCache, KIVICache, cache_factory, calibrate
from llmkit.testing import tiny_llama, tiny_tokenizer

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


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


@pytest.fixture()
def planted_calibrated():
    """A tiny Llama whose kv-heads have outlier key channels (a RoPE pair of k_proj rows scaled 30x),
    calibrated: the score gate keeps outlier pairs, so the 8-bit in-place path runs."""
    model, tok = tiny_llama(), tiny_tokenizer()
    D = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for h in range(model.config.num_key_value_heads):
                for c in (2, 2 + D // 2):
                    layer.self_attn.k_proj.weight[h * D + c] *= 30.0
    g = torch.Generator().manual_seed(0)
    cal = calibrate(model, [torch.randint(3, len(tok), (160,), generator=g) for _ in range(4)], sample_tokens=256)
    return model, tok, cal


def test_staggered_arrivals_join_the_running_inquant_batch_and_answer_as_alone(planted_calibrated):
    """The served-throughput workload with staggered arrivals: later requests join a running batch
    of the calibrated per-token/score InQuant cache (outlier pairs in use), and every answer equals
    that request served alone."""
    model, tok, cal = planted_calibrated
    factory = cache_factory("inquant", layout="per-token", gate="score", calibration=cal)
    probe = factory(model)
    model(torch.randint(3, 100, (1, 8)), past_key_values=probe, use_cache=True)
    assert probe.outlier_pairs()["k"] > 0  # the in-place outlier path is on
    prompts = ["a long first prompt that starts the batch", "hi", "medium size", "four", "and a fifth one"]
    news = [48, 20, 16, 24, 12]
    arrivals = kve.arrival_offsets(len(prompts), gap_s=0.01)
    r = kve.served_throughput(model, tok, prompts, news, max_batch_size=3, cache_factory=factory, arrivals=arrivals)
    assert r["joined"] >= 1 and r["max_batch_seen"] <= 3
    for i, p in enumerate(prompts):
        alone = kve.served_throughput(model, tok, [p], news[i], max_batch_size=3, cache_factory=factory)
        assert r["texts"][i] == alone["texts"][0], p
        assert alone["joined"] == 0


def test_arrival_offsets():
    assert kve.arrival_offsets(5, 0.5, burst=2) == [0.0, 0.0, 0.5, 1.0, 1.5]
    assert kve.arrival_offsets(3, 0.0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="gap_s >= 0"):
        kve.arrival_offsets(3, -1.0)


# ------------------------------------------------------------------------------ the bench's logic


def test_settings_fill_the_quick_defaults():
    full, quick = kve.settings({}), kve.settings({"quick": True, "ppl_n": 3, "acc_names": "bf16,kivi"})
    assert (full["ppl_n"], full["max_new_tokens"], full["acc_names"], full["calib_texts"]) == (40, 256, ["bf16", "inquant"], 16)
    assert (quick["ppl_n"], quick["max_new_tokens"], quick["acc_names"], quick["serve_n"]) == (3, 96, ["bf16", "kivi"], 12)
    assert set(full) == set(kve.SETTINGS) and json.loads(json.dumps(full)) == full  # what a ResultStore compares
    assert kve.part_name("acc", 32) == "acc_0032" and kve.part_name("core", 32) == "core"
    with pytest.raises(ValueError, match="unknown part"):
        kve.part_name("everything")


def test_the_bench_flags_give_the_same_settings():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kv_cache", RESULTS.parent / "kv_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert kve.settings(vars(bench.parser().parse_args([]))) == kve.settings({})
    args = bench.parser().parse_args(["--quick", "--part", "acc", "--acc-start", "6", "--serve-gap", "0.5"])
    assert kve.settings(vars(args)) == kve.settings({"quick": True, "serve_gap": 0.5})


def test_gsm8k_answers_are_graded_by_their_last_number():
    assert kve.last_number("so 3 apples and 1,250.5 dollars.") == "1250.5"
    assert kve.last_number("no digits") is None
    assert kve.same_number("18.0", "18") and not kve.same_number("17", "18") and not kve.same_number(None, "1")
    assert not kve.same_number("-", "1")


def test_accuracy_parts_summarize_and_merge_in_order():
    a = kve.summarize_accuracy({"start": 0, "ok": {"bf16": [True, False], "kivi": [False, False]},
                                "seconds": {"bf16": 1.0, "kivi": 2.0}})
    assert a["n"] == 2 and a["bf16"] == {"accuracy": 50.0, "correct": 1} and a["kivi"]["correct"] == 0
    b = kve.summarize_accuracy({"start": 2, "ok": {"bf16": [True], "kivi": [True]}, "seconds": {"bf16": 1.0, "kivi": 1.0}})
    m = kve.merge_accuracy([b, a])
    assert m["start"] == 0 and m["n"] == 3 and m["bf16"]["correct"] == 2 and m["seconds"]["kivi"] == 3.0
    with pytest.raises(ValueError, match="not consecutive"):
        kve.merge_accuracy([a, b | {"start": 3}])


@pytest.mark.parametrize("name", ["kv_cache", "kv_cache_quick"])
def test_report_gives_the_committed_figures(name, capsys):
    res = json.loads((RESULTS / f"{name}.json").read_text())
    assert kve.report(res) == res["figures"]
    lines = capsys.readouterr().out.splitlines()
    assert any(x.startswith("capacity InQuant") for x in lines) and any(x.startswith("arm inquant/") for x in lines)


def test_the_committed_core_part_merges_into_the_committed_result():
    """``bench/kv_cache.py --merge`` (the full run's settings) rebuilds kv_cache.json from its parts."""
    store = ResultStore(RESULTS / "kv_cache_parts", kve.settings({}))
    res = kve.merge_parts(store)
    res["figures"] = kve.quiet_report(res)
    assert res == json.loads((RESULTS / "kv_cache.json").read_text())


def _acc(start, ok):
    return kve.summarize_accuracy({"start": start, "ok": {"bf16": ok}, "seconds": {"bf16": 1.0}})


def test_merge_parts_takes_the_parts_made_with_the_same_settings(tmp_path, capsys):
    cfg = kve.settings({"quick": True})
    store = ResultStore(tmp_path, cfg)
    with pytest.raises(FileNotFoundError, match="nothing to merge"):
        kve.merge_parts(store)
    store.save("acc_0002", {"quick": True, "max_new_tokens": 96, "gsm8k": _acc(2, [False, True])})
    store.save("acc_0000", {"quick": True, "max_new_tokens": 96, "gsm8k": _acc(0, [True, True])})
    res = kve.merge_parts(store)
    assert "core.json is missing" in capsys.readouterr().out
    assert res["gsm8k"]["n"] == 4 and res["gsm8k"]["bf16"]["correct"] == 3 and "gsm8k" in res
    store.save("core", {"quick": True, "max_new_tokens": 96, "perplexity": {"bf16": 2.0}})
    store.save("acc_0004", {"gsm8k": _acc(4, [True])}, config=kve.settings({"quick": True, "acc_n": 1}))  # other settings
    store.save("all", {"quick": True})  # a whole run's own part is not merged
    res = kve.merge_parts(store)
    assert res["perplexity"] == {"bf16": 2.0} and res["gsm8k"]["n"] == 4
    assert res["parts"] == ["acc_0000.json", "acc_0002.json", "core.json"]


def _gsm8k_rows(n):
    return [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]


def test_accuracy_resumes_after_its_last_saved_batch(tiny_model, tiny_tokenizer):
    caches = kve.Caches(tiny_model, group_size=8)
    items, saved = _gsm8k_rows(5), []
    whole = kve.accuracy(tiny_model, tiny_tokenizer, items, ["bf16", "kivi"], caches, 4, 2, start=10, save=saved.append)
    assert whole["n"] == 5 and len(saved) == 3 and saved[0]["n"] == 2 and whole["start"] == 10
    resumed = kve.accuracy(tiny_model, tiny_tokenizer, items, ["bf16", "kivi"], caches, 4, 2, start=10, resume=saved[0])
    assert resumed["ok"] == whole["ok"]
    with pytest.raises(ValueError, match="cannot resume"):
        kve.accuracy(tiny_model, tiny_tokenizer, items, ["bf16"], caches, 4, 2, start=10, resume=saved[0])
    stopped = kve.accuracy(tiny_model, tiny_tokenizer, items, ["bf16"], caches, 4, 2, budget_s=0.0)
    assert stopped["n"] == 0  # the budget is checked before each batch


def test_caches_are_built_by_name(tiny_model):
    caches = kve.Caches(tiny_model, group_size=8)
    assert caches.make("bf16") is None and caches.engine_factory("bf16") is None
    assert isinstance(caches.make("kivi"), KIVICache)
    none = caches.make("inquant/per-token/none")
    assert none.layers[0].n_outliers == 0 and caches.make("inquant").layers[0].group_size == 8
    assert set(caches.makers(["bf16", "kivi"])) == {"bf16", "kivi"} and caches.makers(["bf16"])["bf16"] is None


@pytest.fixture()
def tiny_run(tmp_path, monkeypatch, shared_data):
    """A tiny model (its calibration under a temporary LLMKIT_HOME) and settings small enough for a test."""
    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path / "home"))
    model, tok = tiny_llama(), tiny_tokenizer()
    model.config._name_or_path = "org/tiny"
    cfg = kve.settings({"quick": True, "group_size": 32, "shots": 1, "ppl_n": 1, "acc_n": 2, "acc_batch": 2,
                        "max_new_tokens": 4, "compress_len": 64, "calib_texts": 1, "long_ctx": 64, "long_tgt": 16,
                        "cap_len": 256, "bytes_len": 64, "cap_gib": 0.01, "serve_n": 2, "serve_new": 4,
                        "serve_gap": 0.0, "serve_bf16_rows": 1})
    kw = {"gsm8k": shared_data / "gsm8k", "math500": shared_data / "math500" / "test.jsonl",
          "store": ResultStore(tmp_path / "parts", cfg), "skip": {"quanto"}}
    return model, tok, cfg, kw


@pytest.mark.slow
def test_a_run_in_parts_saves_resumes_and_merges(tiny_run, tmp_path, monkeypatch, capsys):
    model, tok, cfg, kw = tiny_run
    # the decode section's 48 new tokens per cache (a fixed size, not a setting), run twice here, were 3/4 of this
    # test's time; the section still runs through every cache, with 6 tokens
    decode_speed = kve.decode_speed
    monkeypatch.setattr(kve, "decode_speed", lambda m, t, prompts, names, caches, new_tokens:
                        decode_speed(m, t, prompts, names, caches, min(new_tokens, 6)))
    core = kve.run(model, tok, cfg, part="core", **kw)
    for key in kve.SECTIONS.values():
        assert (key in core) == (key != "gsm8k"), key
    assert core["calibration"]["reused"] is False and set(core["arms"]["per_arm"]) == set(kve.ARMS)
    assert core["served"]["rows"]["bf16"] == 1 and core["served"]["rows"]["inquant"] >= 1
    assert {"capacity_ratio_vs_bf16", "ppl_ratio_kivi", "decode_ratio_vs_bf16"} <= set(core["figures"])
    assert "partial" not in kw["store"].load("core")

    # a part cut short after its arms: a rerun measures only what is missing
    kw["store"].save("core", {k: v for k, v in core.items() if k not in ("decode_tokens_per_s", "figures")}
                     | {"partial": True})
    for section in ("arms_section", "capacity_section", "quant_speed", "served_section", "compression", "perplexity"):
        monkeypatch.setattr(kve, section, lambda *a, **k: pytest.fail("a saved section ran again"))
    again = kve.run(model, tok, cfg, part="core", **kw)
    assert "resuming" in capsys.readouterr().out and again["arms"] == core["arms"]
    assert again["calibration"] == core["calibration"] and "decode_tokens_per_s" in again

    acc = kve.run(model, tok, cfg, part="acc", acc_start=3, out=tmp_path / "acc.json", **kw)
    assert acc["gsm8k"]["start"] == 3 and acc["gsm8k"]["n"] == 2 and "arms" not in acc
    assert acc["calibration"]["reused"] is True and json.loads((tmp_path / "acc.json").read_text()) == acc
    merged = kve.merge_parts(kw["store"])
    assert merged["gsm8k"]["start"] == 3 and merged["arms"] == core["arms"] and merged["parts"] == ["acc_0003.json", "core.json"]
    assert set(kve.quiet_report(merged)) >= {"gsm8k_acc_inquant", "gsm8k_n", "capacity_ratio_vs_bf16"}
