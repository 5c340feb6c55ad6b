"""InQuant quantize-and-pack / unpack-and-dequantize: PyTorch references and Triton kernels.

Paper: "InQuant: in-place mixed-precision KV-cache quantization" (NeurIPS 2026): a 4-bit packed KV cache in which
salient outlier channels keep 8 bits by borrowing the 4-bit slot of a low-saliency neighbour.

Layout (one quantization group = ``G`` consecutive tokens of one (row, kv-head); statistics are
per channel over those tokens, as KIVI does for keys):

- ``packed[..., t, j]`` (uint8) holds channel ``2j`` in the low nibble and ``2j+1`` in the high
  nibble, so the physical data is exactly ``D/2`` bytes per token whatever the outliers are.
- Every channel has a role (per kv-head, from the descriptor): NORMAL channels store a 4-bit
  asymmetric code; an OUTLIER channel stores the low nibble of an 8-bit code in its own slot and
  the high nibble in its DONOR's slot; the donor's own value is not stored, it is approximated by
  its per-group mean (kept in the donor's ``zero`` entry with ``scale = 0``, so the generic
  ``code * scale + zero`` dequantization gives the mean without a special case).
- ``scale``/``zero`` are bf16, one pair per (group, channel): 4 bytes per ``G`` elements. bf16
  rather than fp16 so that extreme magnitudes cannot overflow (fp16 stops at 65504). The zero
  point is rounded *down* to bf16 and the scale is then computed from it and rounded *up*, so
  ``[zero, zero + qmax * scale]`` always covers the group: nothing clips, the error is at most
  half a stored step, and bf16's coarse rounding of the zero point is spread over ``qmax`` steps
  instead of being added to every value.

Per-token layout (``quantize_tokens_ref``/``dequant_tokens_ref``, PyTorch only): one group = the
``D`` channels of one token of one (row, kv-head), so a token can be stored as soon as it arrives
(no full-precision window). The group's bf16 scale/zero come from its NORMAL channels only;
outliers are 8-bit codes on the same grid (bias 128, high nibble in the donor's slot), which is
where in-place outliers pay most: without them an outlier channel sets the step of every channel
of its token. Donors read back as a calibrated per-channel constant.

Heads may keep different numbers of pairs: descriptors are padded to the largest count and the
padding columns point at a normal channel (``valid`` False), which every path writes back as is.

Parameters are rounded to bf16 with explicit directions (the cast's own mode differs between Triton's
interpreter and GPUs), and codes round as ``floor(v + 0.5)`` (not torch's half-to-even), so the Triton
kernels and the references agree bit for bit under ``TRITON_INTERPRET=1``.
The CPU path uses the references; ``backend="triton"`` (default on CUDA tensors) uses the kernels (Triton
is imported lazily). The references are written for CPU speed too: whole-tensor ops only, ``amin``/``amax``
rather than ``aminmax`` (much slower over a non-last dim on CPU), one fused ``even + 16 * odd`` pack and one
``addcmul`` dequantization; the outlier/donor gathers run only when the descriptor keeps a pair. Callers
batch: the InQuant layer quantizes keys and values of all heads and chunks in one call.
"""

from __future__ import annotations

import torch

NORMAL, OUTLIER, DONOR = 0, 1, 2
QMAX4, QMAX8 = 15.0, 255.0


# ----------------------------------------------------------------------------- references


PARAM_DTYPE = torch.bfloat16


def round_down(x: torch.Tensor) -> torch.Tensor:
    """The largest bf16 value <= x, as float32."""
    r = x.to(PARAM_DTYPE)
    return torch.where(r.float() > x, torch.nextafter(r, r.new_tensor(-torch.inf)), r).float()


def round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= x, as float32."""
    r = x.to(PARAM_DTYPE)
    return torch.where(r.float() < x, torch.nextafter(r, r.new_tensor(torch.inf)), r).float()


def asym_params(mn: torch.Tensor, mx: torch.Tensor, qmax) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16-representable (scale, zero) with ``zero <= mn`` and ``zero + qmax * scale >= mx``."""
    zero = round_down(mn)
    return round_up((mx - zero) / qmax), zero


def channel_params(x: torch.Tensor, role: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, zero) over dim -2 of ``x [N, H, G, D]``, as bf16-representable float32."""
    return _channel_params(x.float(), role.to(x.device), bool((role != NORMAL).any()))


def _channel_params(x: torch.Tensor, role: torch.Tensor, pairs: bool):
    mn, mx = x.amin(-2), x.amax(-2)  # (torch.aminmax over a non-last dim is ~15x slower on CPU)
    if not pairs:  # no (outlier, donor) pair: plain 4-bit, no mean needed
        return asym_params(mn, mx, QMAX4)
    r = role[None]
    scale, zero = asym_params(mn, mx, torch.where(r == OUTLIER, QMAX8, QMAX4))
    donor = r == DONOR
    mean = x.sum(-2) / x.shape[-2]
    return torch.where(donor, 0.0, scale), torch.where(donor, round_down(mean), zero)


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., D]`` in [0, 15] (float or uint8) -> ``[..., D/2]`` uint8, channel ``2j`` in the
    low nibble. Float codes are packed with one fused ``even + 16 * odd`` (exact for integers)."""
    if q.dtype == torch.uint8:
        return q[..., 0::2] | (q[..., 1::2] << 4)
    return torch.add(q[..., 0::2], q[..., 1::2], alpha=16).to(torch.uint8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/2]`` uint8 -> ``[..., D]`` uint8 nibble codes (channel 2j = low nibble); left as
    uint8: ``torch.addcmul`` promotes them while it computes ``zero + code * scale``, which saves a
    float copy (a [256, 2] float lookup table and a float cast were both measured slower on CPU)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_pack_ref(x: torch.Tensor, role: torch.Tensor, partner: torch.Tensor):
    """Quantize one group per (row, head): ``x [N, H, G, D]`` -> packed ``[N, H, G, D/2]`` uint8,
    scale/zero ``[N, H, D]`` bf16. ``role [H, D]`` and ``partner [H, D]`` come from the descriptor
    (``partner[h, c]`` is the donor of outlier ``c`` and the outlier of donor ``c``).

    Codes are computed in float32 in place (``floor((x - zero) / scale + 0.5)``, clamped) and
    packed with :func:`pack_codes`; when the descriptor keeps no pair this is the whole work."""
    x = x.float()
    N, H, G, _ = x.shape
    role = role.to(x.device)
    o, d, valid = pairs_from_roles(role, partner.to(x.device))
    scale, zero = _channel_params(x, role, bool(o.shape[1]))
    safe = torch.where(scale > 0, scale, 1.0)[:, :, None, :]
    q = torch.sub(x, zero[:, :, None, :]).div_(safe).add_(0.5).floor_()
    if not o.shape[1]:
        q.clamp_(0.0, QMAX4)
    else:
        qmax = torch.where(role == OUTLIER, QMAX8, QMAX4)[None, :, None, :]
        q.clamp_(min=0.0)
        torch.minimum(q, qmax, out=q)
        # only the 2k outlier/donor columns per head are rewritten: the outlier keeps its low
        # nibble, its donor's slot takes the high nibble (float arithmetic, exact for integers).
        # Padding columns (heads keeping fewer pairs) point at a normal channel and write its
        # own code back.
        oi = o[None, :, None, :].expand(N, H, G, o.shape[1])
        q8 = q.gather(-1, oi)
        hi = q8.mul(1.0 / 16).floor_()
        if not bool(valid.all()):
            hi = torch.where(valid[None, :, None, :], hi, q8)
        q.scatter_(-1, oi, q8 - 16 * torch.where(valid[None, :, None, :], hi, 0.0))
        q.scatter_(-1, d[None, :, None, :].expand_as(oi), hi)
    return pack_codes(q), scale.to(PARAM_DTYPE), zero.to(PARAM_DTYPE)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/2]`` uint8 -> ``[..., D]`` uint8 nibble codes (channel 2j = low nibble)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def dequant_unpack_ref(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_lens: list[int], outliers: torch.Tensor, donors: torch.Tensor,
                       dtype=torch.float32, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize ``packed [N, H, T, D/2]`` with per-group ``scale/zero [N, H, n_groups, D]``.

    ``outliers``/``donors`` ``[H, k]`` (from the descriptor) say where to rebuild 8-bit codes:
    only those ``k`` channels per head are touched after the generic 4-bit pass (nibble split,
    then one fused ``zero + code * scale``). ``valid [H, k]`` marks the columns a head really
    uses (heads may keep different numbers of pairs; padding columns are left as decoded).
    """
    N, H, T, _ = packed.shape
    nib = unpack_codes(packed)
    D = nib.shape[-1]
    s, z = scale.float(), zero.float()
    n = len(group_lens)
    uniform = n > 0 and all(g == group_lens[0] for g in group_lens)
    if uniform:
        G = group_lens[0]
        x = torch.addcmul(z[:, :, :, None, :], nib.view(N, H, n, G, D), s[:, :, :, None, :]).view(N, H, T, D)
    else:
        tok_group = torch.repeat_interleave(torch.arange(n, device=packed.device),
                                            torch.tensor(group_lens, device=packed.device))
        s_t, z_t = s.index_select(2, tok_group), z.index_select(2, tok_group)
        x = torch.addcmul(z_t, nib, s_t)
    k = outliers.shape[-1]
    if k:
        oi = outliers.to(packed.device).long()[None, :, None, :].expand(N, H, T, k)
        di = donors.to(packed.device).long()[None, :, None, :].expand(N, H, T, k)
        q8 = torch.add(nib.gather(-1, oi).float(), nib.gather(-1, di).float(), alpha=16)
        if uniform:
            so = s.gather(-1, oi[:, :, :n])[:, :, :, None, :]
            zo = z.gather(-1, oi[:, :, :n])[:, :, :, None, :]
            xo = (q8.view(N, H, n, G, k) * so + zo).view(N, H, T, k)
        else:
            xo = q8 * s_t.gather(-1, oi) + z_t.gather(-1, oi)
        if valid is not None and not bool(valid.all()):
            xo = torch.where(valid.to(packed.device)[None, :, None, :], xo, x.gather(-1, oi))
        x.scatter_(-1, oi, xo)
    return x.to(dtype)


# ----------------------------------------------------------------------------- per-token groups


def quantize_tokens_ref(x: torch.Tensor, outliers: torch.Tensor, donors: torch.Tensor,
                        valid: torch.Tensor | None = None):
    """Per-token groups with in-place 8-bit outliers: ``x [N, H, T, D]`` -> packed
    ``[N, H, T, D/2]`` uint8 and one bf16 ``scale``/``zero`` per (row, head, token) ``[N, H, T]``.

    The group's range is taken over its NORMAL channels only (outliers and donors excluded), so
    an outlier channel no longer sets every channel's step. Outliers are coded on the same grid
    with 8 bits and a bias of 128 (``value = zero + scale * (q8 - 128)``), the step widened only
    where an outlier would not fit in that code range; the low nibble stays in the outlier's
    slot, the high nibble goes to its donor's slot. A donor's own value is not stored (the
    dequantizer substitutes a calibrated constant, :func:`dequant_tokens_ref`).
    """
    x = x.float()
    N, H, T, D = x.shape
    k = outliers.shape[-1]
    if valid is None:
        valid = torch.ones(H, k, dtype=torch.bool, device=x.device)
    o, d, valid = outliers.to(x.device).long(), donors.to(x.device).long(), valid.to(x.device)
    role, _ = role_maps(o, d, D, valid)
    normal = (role == NORMAL)[None, :, None, :]
    mn = torch.where(normal, x, torch.inf).amin(-1)
    mx = torch.where(normal, x, -torch.inf).amax(-1)
    mn = torch.where(torch.isfinite(mn), mn, 0.0)
    mx = torch.where(torch.isfinite(mx), mx, mn)
    zero = round_down(mn)
    need = (mx - zero) / QMAX4
    if k:
        oi = o[None, :, None, :].expand(N, H, T, k)
        xo = x.gather(-1, oi)
        dev = torch.maximum((xo - zero[..., None]) / 127.0, (zero[..., None] - xo) / 128.0)
        need = torch.maximum(need, torch.where(valid[None, :, None, :], dev, 0.0).amax(-1))
    scale = round_up(need)
    safe = torch.where(scale > 0, scale, 1.0)[..., None]
    q = torch.sub(x, zero[..., None]).div_(safe).add_(0.5).floor_()
    if k:
        q8 = q.gather(-1, oi).add_(128.0).clamp_(0.0, QMAX8)
        q.clamp_(0.0, QMAX4)
        own = q.gather(-1, oi)  # padding columns write their own (normal) code back
        v = valid[None, :, None, :]
        hi = torch.where(v, q8.mul(1.0 / 16).floor(), own)
        lo = torch.where(v, q8 - 16 * hi, own)
        q.scatter_(-1, oi, lo)
        q.scatter_(-1, d[None, :, None, :].expand_as(oi), hi)
    else:
        q.clamp_(0.0, QMAX4)
    return pack_codes(q), scale.to(PARAM_DTYPE), zero.to(PARAM_DTYPE)


def dequant_tokens_ref(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       outliers: torch.Tensor, donors: torch.Tensor, fill: torch.Tensor | None = None,
                       valid: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_tokens_ref`; ``fill [H, k]`` is the value each donor channel is
    read back as (its calibrated mean; zeros when ``None``)."""
    N, H, T, _ = packed.shape
    nib = unpack_codes(packed)
    s, z = scale.float()[..., None], zero.float()[..., None]
    x = torch.addcmul(z, nib, s)
    k = outliers.shape[-1]
    if k:
        dev = packed.device
        if valid is None:
            valid = torch.ones(H, k, dtype=torch.bool, device=dev)
        v = valid.to(dev)[None, :, None, :]
        oi = outliers.to(dev).long()[None, :, None, :].expand(N, H, T, k)
        di = donors.to(dev).long()[None, :, None, :].expand(N, H, T, k)
        q8 = torch.add(nib.gather(-1, oi).float(), nib.gather(-1, di).float(), alpha=16)
        xo = torch.where(v, (q8 - 128.0) * s + z, x.gather(-1, oi))
        fill = torch.zeros(H, k, device=dev) if fill is None else fill.to(dev).float()
        xd = torch.where(v, fill[None, :, None, :].expand(N, H, T, k), x.gather(-1, di))
        x.scatter_(-1, oi, xo)
        x.scatter_(-1, di, xd)
    return x.to(dtype)


# ----------------------------------------------------------------------------- descriptor maps


def role_maps(outliers: torch.Tensor, donors: torch.Tensor, head_dim: int, valid: torch.Tensor | None = None):
    """Descriptor-guided marker recovery: from the compact descriptor (outlier ids + donor ids per
    head) rebuild the per-slot markers (role) and the partner of every marked slot. ``valid
    [H, k]`` marks the pairs a head really uses; padding columns (outlier id = donor id = a
    normal channel) stay NORMAL and their own partner."""
    H, k = outliers.shape
    role = torch.zeros(H, head_dim, dtype=torch.int32, device=outliers.device)
    partner = torch.arange(head_dim, device=outliers.device).repeat(H, 1)
    if k:
        o, d = outliers.long(), donors.long()
        if valid is None:
            role.scatter_(1, o, OUTLIER)
            role.scatter_(1, d, DONOR)
        else:
            valid = valid.to(outliers.device)
            role.scatter_(1, o, torch.where(valid, OUTLIER, NORMAL).to(torch.int32))
            role.scatter_(1, d, torch.where(valid, DONOR, NORMAL).to(torch.int32))
        partner.scatter_(1, o, d)
        partner.scatter_(1, d, o)
    return role, partner


def pairs_from_roles(role: torch.Tensor, partner: torch.Tensor):
    """The inverse of :func:`role_maps` for rows that may keep different numbers of pairs:
    ``(outliers, donors, valid)``, each ``[H, k_max]``; a row with fewer pairs is padded with one
    of its normal channels (as its own donor) and ``valid`` False."""
    H = role.shape[0]
    is_o = role == OUTLIER
    counts = is_o.sum(1)
    k = int(counts.max()) if H else 0
    if k == 0:
        z = torch.zeros(H, 0, dtype=torch.long, device=role.device)
        return z, z, torch.zeros(H, 0, dtype=torch.bool, device=role.device)
    # outlier channels first (in channel order), then the rest; a stable sort keeps the order
    order = torch.sort((~is_o).to(torch.int8), dim=1, stable=True).indices[:, :k]
    valid = torch.arange(k, device=role.device)[None, :] < counts[:, None]
    pad = (role == NORMAL).to(torch.int8).argmax(1, keepdim=True).expand(H, k)
    o = torch.where(valid, order, pad)
    return o, partner.long().gather(1, o), valid


# ----------------------------------------------------------------------------- triton


def _kernels():
    """The Triton module, imported on first use (keeps ``import triton`` out of module import)."""
    import triton

    from llmkit.kernels import kv_quant_triton as k

    return triton, k.quant_kernel, k.dequant_kernel


def quantize_pack_triton(x: torch.Tensor, role: torch.Tensor, partner: torch.Tensor):
    """Triton version of :func:`quantize_pack_ref` (same arguments, same outputs)."""
    triton, quant_kernel, _ = _kernels()
    N, H, G, D = x.shape
    x = x.float().contiguous()
    packed = torch.empty(N, H, G, D // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(N, H, D, dtype=PARAM_DTYPE, device=x.device)
    zero = torch.empty_like(scale)
    quant_kernel[(N * H,)](x, role.to(x.device, torch.int32).contiguous(),
                           partner.to(x.device, torch.int32).contiguous(), packed, scale, zero,
                           H, G, D=D, HALF=D // 2, BG=triton.next_power_of_2(G))
    return packed, scale, zero


def dequant_unpack_triton(packed, scale, zero, group_lens, outliers, donors, dtype=torch.float32, valid=None):
    """Triton version of :func:`dequant_unpack_ref`."""
    triton, _, dequant_kernel = _kernels()
    N, H, T, HALF = packed.shape
    D = 2 * HALF
    role, partner = role_maps(outliers.to(packed.device), donors.to(packed.device), D,
                              None if valid is None else valid.to(packed.device))
    tok_group = torch.repeat_interleave(torch.arange(len(group_lens), device=packed.device),
                                        torch.tensor(group_lens, device=packed.device)).to(torch.int32)
    out = torch.empty(N, H, T, D, dtype=torch.float32, device=packed.device)
    BT = 16
    dequant_kernel[(N * H, triton.cdiv(T, BT))](
        packed.contiguous(), scale.contiguous(), zero.contiguous(), tok_group,
        role.to(torch.int32).contiguous(), partner.to(torch.int32).contiguous(), out,
        H, T, scale.shape[2], D=D, HALF=HALF, BT=BT)
    return out.to(dtype)


# ----------------------------------------------------------------------------- dispatch


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend == "auto":
        return t.is_cuda
    if backend not in ("torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; choose auto, torch or triton")
    return backend == "triton"


def quantize_pack(x, role, partner, backend: str = "auto"):
    if _use_triton(x, backend):
        return quantize_pack_triton(x, role, partner)
    return quantize_pack_ref(x, role, partner)


def dequant_unpack(packed, scale, zero, group_lens, outliers, donors, dtype=torch.float32,
                   backend: str = "auto", valid=None):
    if _use_triton(packed, backend):
        return dequant_unpack_triton(packed, scale, zero, group_lens, outliers, donors, dtype, valid)
    return dequant_unpack_ref(packed, scale, zero, group_lens, outliers, donors, dtype, valid)
