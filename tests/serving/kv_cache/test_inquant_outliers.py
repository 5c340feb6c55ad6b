"""InQuant's outlier path: calibrated saliency, per-head descriptors, the attention-score gate and
per-token key groups. Each test fails if the in-place outlier path is dead or wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from llmkit.kernels import kv_quant as kq
from llmkit.serving.kv_cache import (
    Descriptor,
    InQuantCache,
    InQuantCalibration,
    calibrate,
    gated_descriptor,
    sample_saliency,
)
from llmkit.serving.kv_cache.inquant import candidate_pairs, round_trip, token_saliency
from llmkit.serving.kv_cache.layers import InQuantTokenLayer


def planted(B=1, H=2, T=256, D=16, channels=((3,), (9,)), mag=40.0, seed=0):
    """Gaussian keys with a few planted outlier channels per head (large offset and spread)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    for h, cs in enumerate(channels):
        for c in cs:
            x[:, h, :, c] = mag * (1.0 + torch.randn(B, T, generator=g))
    return x


def score_error(q, k, k_hat):
    """Mean squared error of the attention logits q.k over all (query, key) pairs, per head."""
    return ((q @ k.transpose(-1, -2) - q @ k_hat.transpose(-1, -2)) ** 2).mean(dim=(0, 2, 3))


def planted_llama(head0_only=False):
    """Tiny Llama whose k_proj output channels 2 and 2+8 (a RoPE pair) of kv-head 0 -- and of
    kv-head 1 unless ``head0_only`` -- are scaled up 30x: outlier key channels, as real models have."""
    from llmkit.testing import tiny_llama

    model = tiny_llama(vocab_size=128)
    model.eval()
    D = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.self_attn.k_proj.weight
            for h in ([0] if head0_only else [0, 1]):
                for c in (2, 2 + D // 2):
                    w[h * D + c] *= 30.0
    return model


def calib_texts(n=4, T=160, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (T,), generator=g) for _ in range(n)]


# ------------------------------------------------------------------------------ kernels: ragged pairs


@pytest.mark.parametrize("layout", ["per-channel", "per-token"])
def test_heads_with_different_pair_counts_round_trip_like_each_head_alone(layout):
    x = planted(channels=((3, 4), ()))
    sal = sample_saliency(x, n_samples=256)
    out, don = candidate_pairs(sal, 2, 4)
    ragged = Descriptor.build(out, don, torch.tensor([2, 0]), torch.zeros(2, 2), head_dim=16)
    assert ragged.pairs_per_head.tolist() == [2, 0]
    both = round_trip(x, ragged, layout, 64)
    full = round_trip(x[:, :1], Descriptor.build(out[:1], don[:1], fill=torch.zeros(1, 2)), layout, 64)
    none = round_trip(x[:, 1:], Descriptor.build(out[1:, :0], don[1:, :0]), layout, 64)
    assert torch.equal(both[:, :1], full) and torch.equal(both[:, 1:], none)
    # the padding columns point at channels no real pair uses
    o, d, ok = ragged.outlier_ids, ragged.donor_ids, ragged.valid
    assert not set(o[1].tolist()) & set(torch.cat([o[0], d[0]]).tolist()) or not ok[1].any()


def test_ragged_roles_survive_the_quantize_kernel_reference():
    x = planted(channels=((3,), ()))
    sal = sample_saliency(x, n_samples=256)
    out, don = candidate_pairs(sal, 1, 4)
    desc = Descriptor.build(out, don, torch.tensor([1, 0]), head_dim=16)
    role, partner = kq.role_maps(desc.outlier_ids, desc.donor_ids, 16, desc.valid)
    assert (role == kq.OUTLIER).sum(1).tolist() == [1, 0]
    o, d, ok = kq.pairs_from_roles(role, partner)
    assert ok.tolist() == [[True], [False]] and o[0, 0] == out[0, 0] and d[0, 0] == don[0, 0]


def test_per_token_outliers_are_8_bit_in_place_and_normal_channels_keep_their_step():
    x = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    x[:, 0, :, 5] += 15.0  # outlier channels several times the normal range, within 128 normal steps
    x[:, 1, :, 11] -= 15.0
    sal = token_saliency(x, n_samples=64)  # (a range over tokens cannot see a constant offset)
    assert sal.argmax(1).tolist() == [5, 11] and sample_saliency(x, n_samples=64).argmax(1).tolist() != [5, 11]
    desc = gated_descriptor(sal, 1, 4, gate="off", layout="per-token", mean=x.mean(dim=(0, 2)))
    packed, scale, zero = kq.quantize_tokens_ref(x, desc.outlier_ids, desc.donor_ids, desc.valid)
    assert packed.shape == (1, 2, 64, 8) and scale.shape == (1, 2, 64)  # D/2 bytes + 4 per token
    xq = kq.dequant_tokens_ref(packed, scale, zero, desc.outlier_ids, desc.donor_ids, desc.fill, desc.valid)
    normal = torch.ones(2, 16, dtype=torch.bool)
    normal.scatter_(1, desc.outlier_ids, False).scatter_(1, desc.donor_ids, False)
    err = (xq - x).abs()
    # every channel, outliers included, is within half a step of the per-token grid ...
    oi = desc.outlier_ids[None, :, None, :].expand(1, 2, 64, 1)
    assert (err.gather(-1, oi) <= 0.5 * scale.float()[..., None] + 1e-4).all()
    assert (err[..., normal[0]][:, 0] <= 0.5 * scale.float()[:, 0, :, None] + 1e-4).all()
    # ... and that step is set by the normal channels, not the outlier (several times larger)
    rng_normal = torch.stack([x[0, h][:, normal[h]].amax(-1) - x[0, h][:, normal[h]].amin(-1) for h in range(2)])
    assert (scale.float()[0] <= rng_normal / 15 * 1.05 + 1e-3).float().mean() > 0.9
    # without pairs the outlier sets the step: far coarser
    _, s0, _ = kq.quantize_tokens_ref(x, desc.outlier_ids[:, :0], desc.donor_ids[:, :0])
    assert s0.float().mean() > 3 * scale.float().mean()


# ------------------------------------------------------------------------------ the gate


@pytest.mark.parametrize("layout", ["per-channel", "per-token"])
def test_attention_score_error_is_lower_with_outliers_than_without(layout):
    k = planted(T=256)
    q = torch.randn(1, 2, 64, 16)
    sal = sample_saliency(k, n_samples=256)
    w = torch.einsum("bhtd,bhte->hde", q, q) / q.shape[2]
    mean = k.mean(dim=(0, 2))
    with_o = gated_descriptor(sal, 2, 4, gate="score", x=k, weight=w, layout=layout, group_size=64, mean=mean)
    assert with_o.pairs_per_head.min() >= 1  # the path runs in every head
    without = gated_descriptor(sal, 0, layout=layout)
    e_with = score_error(q, k, round_trip(k, with_o, layout, 64))
    e_without = score_error(q, k, round_trip(k, without, layout, 64))
    assert (e_with < 0.7 * e_without).all(), (e_with, e_without)


def test_score_gate_weighs_key_errors_by_the_queries_that_read_them():
    k = planted(T=256, channels=((3,), (3,)))
    sal = sample_saliency(k, n_samples=256)
    blind = torch.eye(16).repeat(2, 1, 1)
    blind[:, 3, 3] = 0.0  # no query ever reads channel 3: its precision cannot matter to q.k
    reads = torch.eye(16).repeat(2, 1, 1)
    for layout in ("per-channel", "per-token"):
        args = {"x": k, "layout": layout, "group_size": 64, "mean": k.mean(dim=(0, 2))}
        d_reads = gated_descriptor(sal, 1, 4, gate="score", weight=reads, **args)
        d_blind = gated_descriptor(sal, 1, 4, gate="score", weight=blind, **args)
        assert d_reads.pairs_per_head.tolist() == [1, 1]
        if layout == "per-channel":  # per channel, channel 3's own step is all an outlier changes
            assert d_blind.pairs_per_head.tolist() == [0, 0]


def test_score_gate_keeps_nothing_without_outliers_and_gate_off_keeps_everything():
    k = torch.randn(1, 2, 256, 16)
    sal = sample_saliency(k, n_samples=256)
    w = torch.eye(16).repeat(2, 1, 1)
    assert gated_descriptor(sal, 2, 4, gate="score", x=k, weight=w).pairs_per_head.tolist() == [0, 0]
    assert gated_descriptor(sal, 2, 4, gate="off").pairs_per_head.tolist() == [2, 2]
    with pytest.raises(ValueError, match="unknown InQuant gate 'nope'"):
        gated_descriptor(sal, 2, 4, gate="nope")
    with pytest.raises(ValueError, match="needs sample keys"):
        gated_descriptor(sal, 2, 4, gate="score")


def test_one_head_cannot_veto_another():
    k = planted(T=256, channels=((3,), ()))  # only head 0 has an outlier channel
    sal = sample_saliency(k, n_samples=256)
    w = torch.eye(16).repeat(2, 1, 1)
    ratio = gated_descriptor(sal, 1, 4, gate="ratio", min_ratio=15.0)
    score = gated_descriptor(sal, 1, 4, gate="score", x=k, weight=w, group_size=64)
    assert ratio.pairs_per_head.tolist() == [0, 0]  # the first pass's rectangular gate: vetoed
    assert score.pairs_per_head.tolist() == [1, 0]


# ------------------------------------------------------------------------------ calibration + cache


@torch.inference_mode()
def test_calibration_on_a_model_with_outlier_channels_turns_the_outlier_path_on(tmp_path):
    model = planted_llama()
    cal = calibrate(model, calib_texts(), sample_tokens=256)
    H, D = cal.layers[0]["sal_k"].shape
    assert cal.layers[0]["w_k"].shape == (H, D, D) and cal.layers[0]["sample_k"].shape == (H, 256, D)
    # calibrated saliency ranks the planted channels (RoPE pair 2, 2+D/2) first in every head
    top = cal.layers[0]["sal_k"].topk(2, dim=1).indices.sort(1).values
    assert top.tolist() == [[2, 2 + D // 2]] * H
    path = cal.save(tmp_path / "cal.safetensors")
    cache = InQuantCache(model.config, group_size=32, layout="per-token", calibration=str(path))
    assert cache.gate == "score"
    model(torch.randint(3, 128, (1, 40)), past_key_values=cache, use_cache=True)
    pairs = cache.outlier_pairs()
    assert pairs["k"] > 0, pairs
    # the descriptors the cache used are the calibration's (saved and loaded bit for bit)
    again = InQuantCalibration.load(path).descriptor(0, "k", 4, 8, "score", "per-token", 32)
    assert torch.equal(again.outliers, cache.layers[0].descriptors["k"].outliers)


@torch.inference_mode()
@pytest.mark.parametrize("layout", ["per-channel", "per-token"])
def test_outliers_bring_the_model_closer_to_its_unquantized_logits(layout):
    model = planted_llama()
    cal = calibrate(model, calib_texts(), sample_tokens=256)
    ids = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(7))
    ctx, nxt = ids[:, :64], ids[:, 64:]

    def logits(cache):
        if cache is None:
            cache = DynamicCache(config=model.config)
        model(ctx, past_key_values=cache, use_cache=True)
        if hasattr(cache, "flush"):
            cache.flush()
        return model(nxt, past_key_values=cache, use_cache=True).logits

    ref = logits(None)
    with_o = InQuantCache(model.config, group_size=32, layout=layout, calibration=cal, gate="score")
    err_with = (logits(with_o) - ref).pow(2).mean()
    err_without = (logits(InQuantCache(model.config, group_size=32, layout=layout, n_outliers=0)) - ref).pow(2).mean()
    assert with_o.outlier_pairs()["k"] > 0
    assert err_with < err_without, (err_with, err_without)


@torch.inference_mode()
def test_per_token_layer_holds_no_full_precision_window():
    layer = InQuantTokenLayer(n_outliers=1, gate="off")
    k, v = planted(T=10), planted(T=10, seed=1)
    layer.update(k, v)
    layer.update(k[..., :1, :], v[..., :1, :])
    assert layer.keys.shape[-2] == 0 and layer.n_packed == 11 and layer.get_seq_length() == 11
    nb = layer.nbytes()
    assert nb["window"] == 0
    assert nb["packed"] == 2 * 1 * 2 * 11 * 8 and nb["scales"] == 2 * 2 * 1 * 2 * 11 * 2
    out_k, _ = layer.update(k[..., :1, :], v[..., :1, :])
    assert out_k.shape[-2] == 12 and torch.equal(out_k[..., -1:, :], k[..., :1, :])  # the new token as given


def test_cache_refuses_bad_settings(tmp_path):
    from llmkit.testing import tiny_llama

    cfg = tiny_llama(vocab_size=64).config
    with pytest.raises(ValueError, match="unknown InQuant layout 'diagonal'"):
        InQuantCache(cfg, layout="diagonal")
    with pytest.raises(FileNotFoundError, match="InQuant calibration file not found"):
        InQuantCache(cfg, calibration=str(tmp_path / "missing.safetensors"))
    other = calibrate(tiny_llama(vocab_size=64, num_layers=3), [torch.randint(3, 64, (40,))], sample_tokens=32)
    with pytest.raises(ValueError, match="calibration has 3 layers, the model 2"):
        InQuantCache(cfg, calibration=other)


@pytest.mark.bundled
@pytest.mark.slow
@torch.inference_mode()
def test_bundled_model_keeps_outlier_pairs_and_they_help(bundled, shared_data):
    """On SmolLM2 the first pass's gate kept 0 pairs; the calibrated score gate keeps some, per head,
    and with per-token groups they bring the logits closer to the unquantized model's."""
    import json

    model, tok = bundled
    rows = [json.loads(x) for x in (shared_data / "gsm8k" / "train.jsonl").read_text().splitlines()[200:204]]
    texts = [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]
    cal = calibrate(model, texts, tok, max_len=256, sample_tokens=256)
    score = InQuantCache(model.config, layout="per-token", calibration=cal)
    ratio = InQuantCache(model.config, layout="per-token", calibration=cal, gate="ratio")
    none = InQuantCache(model.config, layout="per-token", n_outliers=0)
    ids = tok(" ".join(r["answer"] for r in rows[:2]) * 2, return_tensors="pt").input_ids[:, :160]
    ref = model(ids).logits
    errs = {}
    for name, cache in (("score", score), ("ratio", ratio), ("none", none)):
        model(ids[:, :128], past_key_values=cache, use_cache=True)
        errs[name] = (model(ids[:, 128:], past_key_values=cache, use_cache=True).logits - ref[:, 128:]).pow(2).mean()
    pairs = score.outlier_pairs()
    assert pairs["k"] > 0 and ratio.outlier_pairs()["k"] == 0
    per_head = torch.stack([layer.descriptors["k"].pairs_per_head for layer in score.layers])
    assert len(set(per_head.flatten().tolist())) > 1  # heads decide for themselves
    assert errs["score"] < errs["none"], errs
