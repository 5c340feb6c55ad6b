"""InQuant's decode path: what attention reads each step, from the fast per-token read-back and from the
dequantized copy, must be what the straightforward path (dequantize the whole store with
``dequant_tokens_ref``, then concatenate) gives, and so must the logits."""

from __future__ import annotations

import pytest
import torch

from llmkit.kernels import kv_quant as kq
from llmkit.serving.kv_cache import Descriptor, InQuantCache, calibrate
from llmkit.serving.kv_cache.layers import InQuantTokenLayer, _WindowedQuantLayer


class Straightforward(InQuantTokenLayer):
    """The path before the decode work: the whole store through the reference, then a concatenation."""

    def _dequantize_into(self, which, out):
        _WindowedQuantLayer._dequantize_into(self, which, out)


def descriptors(H=3, D=16, k=3, seed=0):
    """Heads keeping different numbers of pairs (one keeps none), donors read back as random fills."""
    g = torch.Generator().manual_seed(seed)
    o = torch.tensor([[1, 6, 11], [2, 8, 13], [0, 4, 9]])[:H, :k]
    d = o + 1
    return Descriptor.build(o, d, torch.tensor([3, 1, 0])[:H], torch.randn(H, k, generator=g), head_dim=D)


def kv(T, B=2, H=3, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, B, H, T, D, generator=g)
    x[..., 1] *= 30  # an outlier channel, so the 8-bit codes use their high nibble
    return x[0], x[1]


def layers():
    made = [Straightforward(gate="off"), InQuantTokenLayer(gate="off"), InQuantTokenLayer(gate="off", keep_dequantized=True)]
    for layer in made:
        layer.descriptors = {"k": descriptors(), "v": descriptors(seed=1)}
    return made


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_read_back_and_copy_give_the_reference_values(dtype):
    ref, fast, copy = layers()
    steps = [kv(9, seed=0)] + [kv(1, seed=s) for s in range(1, 6)] + [kv(3, seed=9)]
    for k, v in steps:
        k, v = k.to(dtype), v.to(dtype)
        want = ref.update(k, v)
        for layer in (fast, copy):
            got = layer.update(k, v)
            for a, b in zip(got, want):
                assert a.dtype == dtype and torch.equal(a, b)
    # and the read-back is the kernel's reference on the store, rounded once to the model's dtype
    s, d = fast.store["k"], fast.descriptors["k"]
    whole = kq.dequant_tokens_ref(s["packed"], s["scale"], s["zero"], d.outlier_ids, d.donor_ids, d.fill, d.valid)
    out = torch.empty_like(whole, dtype=dtype)
    fast._dequantize_into("k", out)
    assert torch.equal(out, whole.to(dtype)) and torch.equal(copy._deq["k"], whole.to(dtype))


@torch.inference_mode()
def test_copy_follows_batch_edits_and_is_counted():
    _, fast, copy = layers()
    for layer in (fast, copy):
        layer.update(*kv(7))
        layer.batch_select_indices(torch.tensor([1]))
        layer.cut_left(2)
    assert torch.equal(fast.update(*kv(1, B=1, seed=3))[0], copy.update(*kv(1, B=1, seed=3))[0])
    nb = copy.nbytes()
    assert nb["dequantized"] == 2 * 1 * 3 * (7 - 2 + 1) * 16 * 4  # K and V, float32, every packed token
    assert "dequantized" not in fast.nbytes()


@torch.inference_mode()
def test_decode_logits_match_the_straightforward_path():
    from llmkit.testing import tiny_llama

    model = tiny_llama(vocab_size=64)
    cal = calibrate(model, [torch.randint(3, 64, (48,), generator=torch.Generator().manual_seed(0))], sample_tokens=32)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(1))

    def decode(cache):
        out = [model(ids[:, :16], past_key_values=cache).logits]
        for t in range(16, 20):
            out.append(model(ids[:, t:t + 1], past_key_values=cache).logits)
        return torch.cat(out, 1)

    plain = InQuantCache(model.config, layout="per-token", calibration=cal, gate="off")
    for layer in plain.layers:
        layer.__class__ = Straightforward
    want = decode(plain)
    assert sum(int(d.pairs_per_head.sum()) for layer in plain.layers for d in layer.descriptors.values()) > 0
    fast = decode(InQuantCache(model.config, layout="per-token", calibration=cal, gate="off"))
    copy = decode(InQuantCache(model.config, layout="per-token", calibration=cal, gate="off", keep_dequantized=True))
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copy, want, atol=1e-5, rtol=1e-5)


def test_copy_needs_per_token_groups():
    from llmkit.testing import tiny_llama

    with pytest.raises(ValueError, match="keep_dequantized needs layout='per-token'"):
        InQuantCache(tiny_llama(vocab_size=64).config, keep_dequantized=True)
