"""InQuant cache: each method piece on its own, the cache in ``generate``, memory accounting."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from llmkit.kernels import kv_quant as kq
from llmkit.serving.kv_cache import (
    Descriptor,
    InQuantCache,
    KIVICache,
    OutlierBufferCache,
    assign_donors,
    cache_factory,
    estimate_descriptor,
    sample_saliency,
    select_outliers,
)
from llmkit.serving.kv_cache.layers import InQuantLayer, KIVILayer, OutlierBufferLayer

# ----------------------------------------------------------------------------- saliency


def test_sampled_saliency_finds_planted_outlier_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 512, 32, generator=g)
    planted = {0: [5, 17], 1: [0, 31], 2: [12, 13]}
    for h, chans in planted.items():
        x[:, h, :, chans] *= 30.0
    sal = sample_saliency(x, n_samples=16, seed=1)
    assert sal.shape == (3, 32)
    for h, chans in planted.items():
        assert select_outliers(sal, 2)[h].tolist() == chans


def test_saliency_reads_only_the_sampled_tokens():
    x = torch.randn(1, 1, 256, 8)
    sal = sample_saliency(x, n_samples=8, seed=3)
    assert torch.equal(sal, sample_saliency(x, n_samples=8, seed=3))  # seeded
    g = torch.Generator().manual_seed(3)
    idx = torch.randperm(256, generator=g)[:8]
    unsampled = torch.ones(256, dtype=torch.bool)
    unsampled[idx] = False
    y = x.clone()
    y[:, :, unsampled] = 1e6  # never looked at
    assert torch.equal(sample_saliency(y, n_samples=8, seed=3), sal)
    # with fewer tokens than samples it is the exact range
    assert torch.equal(sample_saliency(x[:, :, :5], n_samples=8), x[0, :, :5].amax(1) - x[0, :, :5].amin(1))


# ----------------------------------------------------------------------------- donors


def test_donor_is_the_least_salient_free_neighbour():
    sal = torch.tensor([[5.0, 1.0, 9.0, 0.5, 3.0, 0.1, 2.0, 8.0]])
    donors = assign_donors(sal, torch.tensor([[2]]), max_stride=2)
    assert donors.tolist() == [[3]]  # window {0,1,3,4}: channel 3 is the least salient; 5 is too far
    donors = assign_donors(sal, torch.tensor([[2]]), max_stride=3)
    assert donors.tolist() == [[5]]


def test_adjacent_outliers_take_distinct_donors_further_out():
    sal = torch.ones(1, 16)
    sal[0, 6:9] = 100.0  # a run of three adjacent outliers
    sal[0, 9] = 0.5
    out = select_outliers(sal, 3)
    assert out.tolist() == [[6, 7, 8]]
    donors = assign_donors(sal, out, max_stride=4)[0].tolist()
    assert len(set(donors)) == 3 and not set(donors) & {6, 7, 8}
    assert all(abs(d - o) <= 4 for d, o in zip(donors, out[0].tolist()))
    assert 9 in donors  # the least salient channel in reach is used
    assert any(abs(d - o) > 1 for d, o in zip(donors, out[0].tolist()))  # stride > 1 was needed


def test_outlier_run_wider_than_the_window_falls_back_to_any_free_channel():
    sal = torch.ones(1, 8)
    sal[0, :3] = 100.0
    sal[0, 7] = 0.1
    out = select_outliers(sal, 3)
    donors = assign_donors(sal, out, max_stride=1)[0].tolist()
    assert len(set(donors)) == 3 and not set(donors) & {0, 1, 2}
    assert 7 in donors  # outside every stride window: only the fallback could pick it
    with pytest.raises(ValueError, match="donor"):
        assign_donors(torch.ones(1, 8), torch.tensor([[0, 1, 2, 3, 4]]))  # 5 outliers, 3 free slots


def test_slot_reuse_is_kept_only_where_it_pays():
    from llmkit.serving.kv_cache.inquant import worthwhile_pairs

    sal = torch.tensor([[100.0, 1.0, 5.0, 2.0], [10.0, 1.0, 4.0, 3.0]])
    out, don = torch.tensor([[0, 2], [0, 2]]), torch.tensor([[1, 3], [1, 3]])
    assert worthwhile_pairs(sal, out, don, min_ratio=15.0).tolist() == [[], []]  # head 1: 10 < 15*1
    sal[1, 0] = 20.0
    assert worthwhile_pairs(sal, out, don, min_ratio=15.0).tolist() == [[0], [0]]  # 5 < 15*2: dropped
    assert worthwhile_pairs(sal, out, don, min_ratio=0.0).tolist() == [[0, 1], [0, 1]]
    x = torch.randn(1, 2, 64, 16)
    assert estimate_descriptor(x, n_outliers=2).outliers.shape == (2, 0)  # gaussian: nothing pays
    x[:, :, :, 7] *= 100.0
    d = estimate_descriptor(x, n_outliers=2)
    assert d.outlier_ids.tolist() == [[7], [7]]


def test_descriptor_is_compact_and_round_trips():
    out, don = torch.tensor([[3, 10], [0, 1]]), torch.tensor([[1, 14], [2, 5]])
    d = Descriptor.build(out, don)
    assert d.outliers.dtype == torch.uint8 and d.offsets.dtype == torch.int8
    assert d.nbytes == 2 * out.numel()
    assert torch.equal(d.outlier_ids, out) and torch.equal(d.donor_ids, don)


def test_marker_recovery_from_descriptor():
    role, partner = kq.role_maps(torch.tensor([[3, 10]]), torch.tensor([[1, 14]]), 16)
    assert (role[0] == kq.OUTLIER).nonzero().flatten().tolist() == [3, 10]
    assert (role[0] == kq.DONOR).nonzero().flatten().tolist() == [1, 14]
    assert partner[0, 3] == 1 and partner[0, 1] == 3 and partner[0, 10] == 14 and partner[0, 14] == 10
    assert partner[0, 0] == 0  # unmarked slots point at themselves


# ----------------------------------------------------------------------------- slot reuse, group scales


def _roundtrip(x, outliers, donors, lens=None):
    role, partner = kq.role_maps(outliers, donors, x.shape[-1])
    packed, scale, zero = kq.quantize_pack_ref(x, role, partner)
    y = kq.dequant_unpack_ref(packed, scale[:, :, None], zero[:, :, None], [x.shape[-2]], outliers, donors)
    return packed, scale, zero, y


def test_outlier_high_nibble_lives_in_the_donor_slot_and_donor_becomes_its_mean():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, :, 0] = torch.tensor([0.0, 255.0, 17.0, 34.0])  # range 255: the 8-bit step is exactly 1
    x[0, 0, :, 1] = torch.tensor([1.0, 2.0, 3.0, 6.0])  # donor, mean 3
    x[0, 0, :, 2] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    packed, scale, _zero, y = _roundtrip(x, torch.tensor([[0]]), torch.tensor([[1]]))
    codes = kq.unpack_nibbles(packed)[0, 0]
    assert codes[:, 0].tolist() == [0, 15, 1, 2]  # low nibbles of 0, 255, 17, 34
    assert codes[:, 1].tolist() == [0, 15, 1, 2]  # their high nibbles, in the donor's slot
    assert torch.equal(y[0, 0, :, 0], x[0, 0, :, 0])  # 8 bits: exact on this grid
    assert y[0, 0, :, 1].tolist() == [3.0] * 4 and scale[0, 0, 1] == 0
    assert packed.shape[-1] == 2  # still 4 bits per channel on disk


def test_group_wise_scales_isolate_groups():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 1, 8, 8, generator=g)
    b = 1000.0 * torch.randn(1, 1, 8, 8, generator=g)
    o, d = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)
    alone = _roundtrip(a, o, d)[3]
    role, partner = kq.role_maps(o, d, 8)
    pa, sa, za = kq.quantize_pack_ref(a, role, partner)
    pb, sb, zb = kq.quantize_pack_ref(b, role, partner)
    y = kq.dequant_unpack_ref(torch.cat([pa, pb], 2), torch.stack([sa, sb], 2), torch.stack([za, zb], 2),
                              [8, 8], o, d)
    assert torch.equal(y[:, :, :8], alone)  # the huge second group does not touch the first's scale
    assert (y[:, :, :8] - a).abs().max() < 0.2


# ----------------------------------------------------------------------------- property test

hyp = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), mag=st.sampled_from([1e-4, 1.0, 50.0, 1e6]),
       adjacent=st.booleans(), zero_group=st.booleans(), G=st.sampled_from([4, 16, 33]))
def test_error_bounds_hold_for_planted_outliers(seed, mag, adjacent, zero_group, G):
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 16
    x = mag * torch.randn(2, H, G, D, generator=g)
    planted = [5, 6] if adjacent else [3, 11]
    x[:, :, :, planted] = x[:, :, :, planted] * 100.0 + mag * 10.0  # big and offset
    if zero_group:
        x[0] = 0.0
    desc = estimate_descriptor(x, n_outliers=2, max_stride=3, n_samples=8, seed=seed, min_ratio=0.0)
    o, d = desc.outlier_ids, desc.donor_ids
    assert set(o[0].tolist()) == set(planted) or G <= 8  # few tokens: sampling sees all of them
    _packed, scale, _zero, y = _roundtrip(x, o, d)
    err = (y - x).abs().amax(2)  # [N, H, D]
    mn, rng = x.amin(2), x.amax(2) - x.amin(2)
    slack = 1e-6 * x.abs().amax(2)  # float32 arithmetic
    role = kq.role_maps(o, d, D)[0]
    for h in range(H):
        for c in range(D):
            r = role[h, c].item()
            if r == kq.DONOR:  # approximated by its group mean (bf16)
                bound = rng[:, h, c] + 2 ** -8 * x[:, h, :, c].abs().amax(-1)
            else:
                qmax = 255 if r == kq.OUTLIER else 15
                # half a step; the step may exceed range/qmax only by the bf16 rounding of the zero
                # point (spread over qmax steps) and of the scale itself
                step = (rng[:, h, c] + 2 ** -7 * mn[:, h, c].abs()) / qmax * (1 + 2 ** -7)
                assert (scale[:, h, c].float() <= step + slack[:, h, c]).all()
                bound = step / 2
            assert (err[:, h, c] <= bound + slack[:, h, c]).all(), (h, c, r)
    if zero_group:
        assert torch.equal(y[0], torch.zeros_like(y[0]))


# ----------------------------------------------------------------------------- the cache


def _kv(T, B=1, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


def test_new_tokens_are_appended_without_requantizing_old_groups():
    layer = InQuantLayer(group_size=8, n_outliers=2, min_ratio=0.0)
    k, v = _kv(13)
    out_k, _ = layer.update(k, v)
    assert torch.equal(out_k, k)  # the current pass attends to its own tokens unquantized
    assert layer.n_packed == 8 and layer.keys.shape[-2] == 5 and layer.get_seq_length() == 13
    packed0 = layer.store["k"]["packed"].clone()
    scale0 = layer.store["k"]["scale"].clone()
    for i in range(11):  # decode one token at a time: a second group fills at 16
        k1, v1 = _kv(1, seed=100 + i)
        out_k, _out_v = layer.update(k1, v1)
        assert out_k.shape[-2] == 14 + i
    assert layer.n_packed == 24 and layer.group_lens == [8, 8, 8]
    assert torch.equal(layer.store["k"]["packed"][:, :, :8], packed0)
    assert torch.equal(layer.store["k"]["scale"][:, :, :1], scale0)
    deq = layer._dequantize("k")
    assert (deq[:, :, :8] - k[:, :, :8]).abs().mean() < 0.3  # donors (group mean) err more


@pytest.mark.parametrize("planted", ["keys", "both", "none"])
def test_keys_and_values_quantized_together_equal_each_side_alone(planted):
    # the layer quantizes keys and values (all heads, all chunks) in one call when both sides keep
    # as many pairs, else side by side; either way the store must be what quantizing each
    # (row, head, chunk) group alone with that side's descriptor gives
    layer = InQuantLayer(group_size=8, n_outliers=2)
    k, v = _kv(24, B=2, H=3, seed=5)
    if planted in ("keys", "both"):
        k[..., 5] *= 200.0
    if planted == "both":
        v[..., 9] *= 200.0
    layer.update(k, v)
    kept = {w: d.outliers.shape[1] for w, d in layer.descriptors.items()}
    assert kept == {"keys": {"k": 1, "v": 0}, "both": {"k": 1, "v": 1}, "none": {"k": 0, "v": 0}}[planted]
    for which, x in (("k", k), ("v", v)):
        d = layer.descriptors[which]
        role, partner = kq.role_maps(d.outlier_ids, d.donor_ids, 16)
        for c in range(3):
            p, sc, z = kq.quantize_pack_ref(x[:, :, 8 * c:8 * c + 8], role, partner)
            st = layer.store[which]
            assert torch.equal(st["packed"][:, :, 8 * c:8 * c + 8], p)
            assert torch.equal(st["scale"][:, :, c], sc) and torch.equal(st["zero"][:, :, c], z)


def test_no_pair_shortcut_gives_the_full_search_result():
    from llmkit.serving.kv_cache.inquant import descriptor_from_saliency, worthwhile_pairs

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        sal = torch.rand(3, 16, generator=g) * 10 ** (3 * torch.rand(3, 1, generator=g))
        ratio = [0.0, 2.0, 15.0][trial % 3]
        out = select_outliers(sal, 3)
        don = assign_donors(sal, out, max_stride=4)
        keep = worthwhile_pairs(sal, out, don, ratio)
        d = descriptor_from_saliency(sal, 3, max_stride=4, min_ratio=ratio)
        assert torch.equal(d.outlier_ids, out.gather(1, keep)) and torch.equal(d.donor_ids, don.gather(1, keep))


def test_flush_quantizes_the_window_as_a_short_group():
    layer = InQuantLayer(group_size=8, n_outliers=2, min_ratio=0.0)
    k, v = _kv(11)
    layer.update(k, v)
    layer.flush()
    assert layer.n_packed == 11 and layer.group_lens == [8, 3] and layer.keys.shape[-2] == 0
    k1, v1 = _kv(1, seed=5)
    out_k, _ = layer.update(k1, v1)
    assert (out_k[:, :, :11] - k).abs().mean() < 0.3 and torch.equal(out_k[:, :, 11:], k1)


@pytest.mark.parametrize("cls", [InQuantLayer, KIVILayer, OutlierBufferLayer])
def test_memory_accounting_counts_what_is_held(cls):
    layer = cls(group_size=8, **({"min_ratio": 0.0} if cls is InQuantLayer else {}))
    B, H, T, D = 2, 2, 24, 16
    k, v = _kv(T + 3, B=B)
    layer.update(k, v)
    nb = layer.nbytes()
    assert nb["packed"] == 2 * B * H * T * D // 2  # exactly 4 bits per element
    assert nb["window"] == 2 * B * H * 3 * D * 4  # three float32 tokens wait unquantized
    held = sum(t.numel() * t.element_size() for s in layer.store.values() for t in s.values())
    assert nb["packed"] + nb["scales"] + nb["outliers"] == held
    if cls is InQuantLayer:  # K and V: k outliers x (id + offset) per head
        assert nb["descriptors"] == sum(2 * H * d.outliers.shape[1] for d in layer.descriptors.values())
        assert nb["scales"] == 2 * B * H * (T // 8) * D * 2 * 2  # fp16 scale + zero per group, channel


def test_reorder_and_batch_select_are_exact():
    layer = InQuantLayer(group_size=4, n_outliers=1, min_ratio=0.0)
    k, v = _kv(10, B=3)
    layer.update(k, v)
    before = layer._dequantize("k")
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer._dequantize("k"), before[[2, 0, 1]])
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer._dequantize("k"), before[[0]]) and layer.get_seq_length() == 10
    with pytest.raises(NotImplementedError):
        layer.crop(-1)


@torch.inference_mode()
def test_inquant_cache_in_generate_with_defaults(tiny_model, tiny_tokenizer):
    enc = tiny_tokenizer(["hello world, this is a test"], return_tensors="pt")
    cache = InQuantCache(tiny_model.config)
    out = tiny_model.generate(**enc, max_new_tokens=5, do_sample=False, past_key_values=cache,
                              pad_token_id=tiny_tokenizer.pad_token_id)
    assert out.shape[1] == enc.input_ids.shape[1] + 5
    assert cache.get_seq_length() == out.shape[1] - 1
    assert len(cache.layers) == tiny_model.config.num_hidden_layers


@torch.inference_mode()
def test_quantized_past_changes_logits_only_slightly(tiny_model):
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = DynamicCache(config=tiny_model.config)
    tiny_model(ids[:, :32], past_key_values=ref)
    want = tiny_model(ids[:, 32:], past_key_values=ref).logits
    for cls in (InQuantCache, KIVICache, OutlierBufferCache):
        cache = cls(tiny_model.config, group_size=16)
        tiny_model(ids[:, :32], past_key_values=cache)
        assert cache.nbytes()["window"] == 0  # 32 tokens = two full groups, all packed
        assert cache.bf16_nbytes() / cache.nbytes()["packed"] == 4.0
        got = tiny_model(ids[:, 32:], past_key_values=cache).logits
        assert not torch.equal(got, want)  # the past really is read back quantized
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_cache_factory_contract(tiny_model):
    for name in (None, "none", "bf16", "dynamic", "BF16"):
        assert cache_factory(name) is None
    for name, cls in (("inquant", InQuantCache), ("kivi", KIVICache), ("outlier-buffer", OutlierBufferCache)):
        assert isinstance(cache_factory(name)(tiny_model), cls)
    with pytest.raises(ValueError, match="inquant.*kivi.*outlier-buffer"):
        cache_factory("int3")


def test_hf_engine_generates_with_inquant(tiny_model, tiny_tokenizer):
    from llmkit.engines.hf import HFEngine
    from llmkit.generation import GenerationParams

    eng = HFEngine(tiny_model, tiny_tokenizer, batch_size=2, cache_factory=cache_factory("inquant"))
    outs = eng.generate(["abc", "hello there"], GenerationParams(max_new_tokens=4))
    assert [len(o) for o in outs] == [1, 1] and all(o[0].completion_tokens <= 4 for o in outs)


@pytest.mark.bundled
@torch.inference_mode()
def test_bundled_model_generates_and_compresses(bundled):
    model, tok = bundled
    enc = tok(["The capital of France is"], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=8, do_sample=False)
    cache = InQuantCache(model.config, group_size=4)  # small groups: the prompt is read back quantized
    got = model.generate(**enc, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert "Paris" in tok.decode(got[0, enc.input_ids.shape[1]:])
    assert got.shape == ref.shape
    long = tok(" ".join(["The quick brown fox jumps over the lazy dog."] * 30), return_tensors="pt").input_ids
    cache = InQuantCache(model.config)
    model(long[:, :256], past_key_values=cache)
    nb = cache.nbytes()
    assert cache.bf16_nbytes() / nb["packed"] == 4.0
    assert cache.bf16_nbytes() / (nb["packed"] + nb["scales"] + nb["descriptors"]) >= 3.7
