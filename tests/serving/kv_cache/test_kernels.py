"""InQuant Triton kernels vs their PyTorch references, run by Triton's interpreter on CPU.

The kernels run through the workbench's ``run_interpreted`` (below), so this file sets no
TRITON_INTERPRET: that variable is read when kernels are decorated and would leak into every test
collected after this one. Shapes stay tiny: the interpreter runs kernels in numpy, slowly.
"""

from __future__ import annotations

import pytest
import torch

from llmkit.kernels import kv_quant as kq


class _Interpreted:
    """``kernel[grid](...)`` run by Triton's interpreter through the kernel workbench, whichever mode the
    kernel module was imported in (Triton fixes that at decoration time; the workbench compiles the same
    kernels for GPU targets in this process, so no TRITON_INTERPRET is set here)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        from llmkit.kernels.workbench.compiled import run_interpreted

        return lambda *args, **kwargs: run_interpreted(self.kernel, grid, *args, **kwargs)


@pytest.fixture(autouse=True)
def _interpreted_kernels(monkeypatch):
    import triton

    from llmkit.kernels import kv_quant_triton as k

    monkeypatch.setattr(kq, "_kernels", lambda: (triton, _Interpreted(k.quant_kernel),
                                                 _Interpreted(k.dequant_kernel)))


D = 16


def _case(seed, N=2, H=2, G=8, outliers=((3, 4), (0, 9)), donors=((2, 6), (1, 8))):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, G, D, generator=g)
    x[..., 3] *= 40.0
    x[..., 4] = x[..., 4] * 25.0 + 100.0
    x[:, :, :, 9] *= 1e3
    o, d = torch.tensor(outliers, dtype=torch.long), torch.tensor(donors, dtype=torch.long)
    return x, o, d


@pytest.mark.parametrize("G", [8, 6])  # 6: the token block is masked (not a power of two)
@pytest.mark.parametrize("descr", ["outliers", "none", "adjacent"])
def test_quantize_kernel_matches_reference_bit_for_bit(G, descr):
    x, o, d = _case(0, G=G)
    if descr == "none":
        o, d = o[:, :0], d[:, :0]
    elif descr == "adjacent":  # outliers 3,4 side by side, donors at stride 2
        o, d = torch.tensor([[3, 4], [7, 8]]), torch.tensor([[1, 6], [5, 10]])
    role, partner = kq.role_maps(o, d, D)
    ref = kq.quantize_pack_ref(x, role, partner)
    tri = kq.quantize_pack_triton(x, role, partner)
    for a, b, name in zip(ref, tri, ("packed", "scale", "zero")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("lens", [[8, 8, 8], [8, 5, 3]])  # uniform groups and ragged (flushed) ones
def test_dequant_kernel_matches_reference(lens):
    parts = []
    o = d = None
    for i, G in enumerate(lens):
        x, o, d = _case(i + 1, G=G)
        role, partner = kq.role_maps(o, d, D)
        parts.append(kq.quantize_pack_ref(x, role, partner))
    packed = torch.cat([p[0] for p in parts], dim=2)
    scale = torch.stack([p[1] for p in parts], dim=2)
    zero = torch.stack([p[2] for p in parts], dim=2)
    ref = kq.dequant_unpack_ref(packed, scale, zero, lens, o, d)
    tri = kq.dequant_unpack_triton(packed, scale, zero, lens, o, d)
    assert tri.shape == ref.shape == (2, 2, sum(lens), D)
    torch.testing.assert_close(tri, ref, rtol=1e-6, atol=1e-5)


def test_round_trip_through_both_kernels_recovers_outliers_at_8_bits():
    x, o, d = _case(7)
    role, partner = kq.role_maps(o, d, D)
    packed, scale, zero = kq.quantize_pack_triton(x, role, partner)
    y = kq.dequant_unpack_triton(packed, scale[:, :, None], zero[:, :, None], [8], o, d)
    rng = x.amax(2) - x.amin(2)  # [N, H, D]
    err = (y - x).abs().amax(2)
    for h in range(2):
        for c in o[h].tolist():  # 8-bit bound: half a step of range/255, plus bf16 parameter rounding
            step = (rng[:, h, c] + 2 ** -7 * x[:, h, :, c].abs().amax(-1)) / 255 * (1 + 2 ** -7)
            assert (err[:, h, c] <= step / 2 + 1e-4).all()


def test_pack_layout_is_two_channels_per_byte_low_nibble_first():
    x = torch.zeros(1, 1, 2, 4)
    x[0, 0, 1] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # per-channel min 0, max = value: codes 0 / 15
    role, partner = kq.role_maps(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), 4)
    packed, _, _ = kq.quantize_pack_ref(x, role, partner)
    assert packed.shape == (1, 1, 2, 2) and packed.dtype == torch.uint8
    assert packed[0, 0, 0].tolist() == [0, 0] and packed[0, 0, 1].tolist() == [0xFF, 0xFF]
    assert torch.equal(kq.quantize_pack_triton(x, role, partner)[0], packed)


def test_backend_dispatch():
    x, o, d = _case(3)
    role, partner = kq.role_maps(o, d, D)
    a = kq.quantize_pack(x, role, partner)  # CPU tensors: the reference
    b = kq.quantize_pack_ref(x, role, partner)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    with pytest.raises(ValueError, match="backend"):
        kq.quantize_pack(x, role, partner, backend="cuda-magic")


def test_kernels_handle_heads_with_different_pair_counts():
    # head 0 keeps both pairs, head 1 none: the descriptor is padded (valid False) for head 1
    from llmkit.serving.kv_cache import Descriptor

    x, o, d = _case(3)
    desc = Descriptor.build(o, d, torch.tensor([2, 0]), head_dim=D)
    o, d, ok = desc.outlier_ids, desc.donor_ids, desc.valid
    role, partner = kq.role_maps(o, d, D, ok)
    assert (role != kq.NORMAL).sum(1).tolist() == [4, 0]
    ref = kq.quantize_pack_ref(x, role, partner)
    tri = kq.quantize_pack_triton(x, role, partner)
    for a, b, name in zip(ref, tri, ("packed", "scale", "zero")):
        assert torch.equal(a, b), name
    y_ref = kq.dequant_unpack_ref(ref[0], ref[1][:, :, None], ref[2][:, :, None], [8], o, d, valid=ok)
    y_tri = kq.dequant_unpack_triton(ref[0], ref[1][:, :, None], ref[2][:, :, None], [8], o, d, valid=ok)
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-6, atol=1e-5)
    # head 1 is plain 4-bit: the same as quantizing it with an empty descriptor
    empty = kq.role_maps(o[1:, :0], d[1:, :0], D)
    plain = kq.quantize_pack_ref(x[:, 1:], *empty)
    assert torch.equal(ref[0][:, 1:], plain[0]) and torch.equal(ref[1][:, 1:], plain[1])
