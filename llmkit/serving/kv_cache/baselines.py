"""Baseline KV quantizers sharing InQuant's 4-bit nibble packing.

- KIVI-style uniform 4-bit (KIVI, Liu et al. 2024): keys per channel over a group of tokens,
  values per token over the head dimension, asymmetric min/max, bf16 scale and zero-point.
- Outlier buffer, dense-and-sparse (KVQuant-style, Hooper et al. 2024): the same dense 4-bit
  quantization with the largest-magnitude ``outlier_frac`` of each (row, head, chunk) pulled out
  into a separate buffer of fp16 values plus int32 positions; the dense ranges are computed
  without them and the outliers are scattered back after dequantization. Deviation: KVQuant
  calibrates its thresholds offline (and quantizes keys before RoPE); here the outliers are
  chosen online with ``topk`` per chunk, which needs no calibration data.

Codes use the same rounding and bf16 parameters as ``llmkit.kernels.kv_quant``.
"""

from __future__ import annotations

import math

import torch

from llmkit.kernels.kv_quant import PARAM_DTYPE, asym_params, pack_codes, unpack_codes


def quantize_axis(x: torch.Tensor, axis: int, mask: torch.Tensor | None = None):
    """4-bit asymmetric quantization of ``x [..., T, D]`` with statistics over ``axis`` (-2: per
    channel, -1: per token). ``mask`` (True = outlier) excludes entries from the range.
    Returns packed ``[..., T, D/2]`` uint8 and bf16 scale/zero with ``axis`` kept as size 1."""
    x = x.float()
    if mask is None:
        mn, mx = x.amin(axis, keepdim=True), x.amax(axis, keepdim=True)
    else:
        mn = torch.where(mask, math.inf, x).amin(axis, keepdim=True)
        mx = torch.where(mask, -math.inf, x).amax(axis, keepdim=True)
        mn = torch.where(torch.isfinite(mn), mn, 0.0)
        mx = torch.where(torch.isfinite(mx), mx, 0.0)
    scale, zero = asym_params(mn, mx, 15.0)
    safe = torch.where(scale > 0, scale, 1.0)
    q = torch.sub(x, zero).div_(safe).add_(0.5).floor_().clamp_(0.0, 15.0)
    return pack_codes(q), scale.to(PARAM_DTYPE), zero.to(PARAM_DTYPE)


def dequant_tokens(packed, scale, zero):
    """Per-token groups: ``scale/zero [..., T, 1]``."""
    return torch.addcmul(zero.float(), unpack_codes(packed), scale.float())


def dequant_channels(packed, scale, zero, group_lens: list[int]):
    """Per-channel groups: ``scale/zero [N, H, n_groups, D]`` over ``group_lens`` tokens each."""
    N, H, T, _ = packed.shape
    nib = unpack_codes(packed)
    n = len(group_lens)
    if n and all(g == group_lens[0] for g in group_lens):
        x = torch.addcmul(zero.float()[:, :, :, None], nib.view(N, H, n, group_lens[0], -1),
                          scale.float()[:, :, :, None])
        return x.view(N, H, T, -1)
    tok = torch.repeat_interleave(torch.arange(n, device=packed.device),
                                  torch.tensor(group_lens, device=packed.device))
    return torch.addcmul(zero.float().index_select(2, tok), nib, scale.float().index_select(2, tok))


def split_outliers(x: torch.Tensor, frac: float):
    """Top-``frac`` |x| entries of each ``[N, H, G, D]`` chunk: (mask, fp16 values, int32 flat positions)."""
    N, H, G, D = x.shape
    k = max(1, math.ceil(frac * G * D))
    flat = x.reshape(N, H, G * D)
    idx = flat.abs().topk(k, dim=-1).indices
    vals = flat.gather(-1, idx).to(torch.float16)
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True).view(N, H, G, D)
    return mask, vals, idx.to(torch.int32)
