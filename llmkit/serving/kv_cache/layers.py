"""Cache layers (transformers' ``CacheLayerMixin`` API) for InQuant and the baselines.

All three share one storage policy (``_WindowedQuantLayer``): the newest tokens wait in a small
full-precision window; each time it holds ``group_size`` tokens the full chunk is quantized and
*appended* to the packed store. Old chunks are never re-quantized (unlike transformers'
``QuantizedLayer``, which re-quantizes the whole sequence whenever its residual window fills).
``flush()`` quantizes whatever the window holds as one (shorter) group.

``update`` returns the dequantized store, then the window, then the new states in full precision:
the tokens of the current forward pass attend to each other unquantized (as in KIVI), every
earlier token is read back from the quantized store once it has been flushed.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from llmkit.kernels.kv_quant import (
    dequant_tokens_ref,
    dequant_unpack,
    quantize_pack,
    quantize_tokens_ref,
    role_maps,
)
from llmkit.serving.kv_cache import baselines as bl
from llmkit.serving.kv_cache.inquant import (
    GATES,
    Descriptor,
    descriptor_from_saliency,
    gated_descriptor,
    sample_saliency,
    token_saliency,
)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _WindowedQuantLayer(DynamicLayer):
    is_croppable = False

    def __init__(self, group_size: int = 128):
        super().__init__()
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self._clear()

    def _clear(self):
        self.store: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        self.group_lens: list[int] = []
        self.n_packed = 0

    # -- subclass hooks ----------------------------------------------------------------------
    def _quantize(self, x: torch.Tensor, which: str, G: int) -> dict[str, torch.Tensor]:
        """Quantize ``x [B, H, n*G, D]`` as ``n`` groups of ``G`` tokens; tensors concat on dim 2."""
        raise NotImplementedError

    def _dequantize(self, which: str) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize_into(self, which: str, out: torch.Tensor) -> None:
        """Write the dequantized store into ``out`` (a view of the tensor ``update`` returns)."""
        out.copy_(self._dequantize(which))

    def _read(self, which: str, new: torch.Tensor) -> torch.Tensor:
        """The store, the window and ``new`` along the sequence, built in place: the store is
        dequantized straight into its slice of the result (no second float pass to concatenate)."""
        window = self.keys if which == "k" else self.values
        B, H, n, D = new.shape
        p, w = self.n_packed, window.shape[-2]
        out = new.new_empty(B, H, p + w + n, D)
        self._dequantize_into(which, out[:, :, :p])
        if w:
            out[:, :, p:p + w] = window
        out[:, :, p + w:] = new
        return out

    def _meta_nbytes(self) -> int:
        return 0

    # -- storage -------------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor, G: int):
        n = k.shape[-2]
        for which, x in (("k", k), ("v", v)):
            new = self._quantize(x, which, G)
            old = self.store[which]
            self.store[which] = {name: torch.cat([old[name], t], dim=2) if name in old else t
                                 for name, t in new.items()}
        self.group_lens += [G] * (n // G)
        self.n_packed += n

    def _drain(self, all_of_it: bool = False):
        w = self.keys.shape[-2]
        n = w if all_of_it else (w // self.group_size) * self.group_size
        if n == 0:
            return
        G = n if all_of_it else self.group_size
        self._append(self.keys[..., :n, :], self.values[..., :n, :], G)
        self.keys = self.keys[..., n:, :].clone()
        self.values = self.values[..., n:, :].clone()

    def flush(self):
        """Quantize the full-precision window now (as one group of its current length)."""
        if self.is_initialized and self.keys.shape[-2]:
            self._drain(all_of_it=True)

    # -- CacheLayerMixin -------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.n_packed:
            keys_out, values_out = self._read("k", key_states), self._read("v", value_states)
        else:
            keys_out = torch.cat([self.keys, key_states], dim=-2)
            values_out = torch.cat([self.values, value_states], dim=-2)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._drain()
        return keys_out, values_out

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.n_packed + self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot crop: packed groups are not split")

    def _map_batch(self, fn):
        for which in ("k", "v"):
            self.store[which] = {name: fn(t) for name, t in self.store[which].items()}
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # exact: rows are permuted in packed form, nothing is re-quantized
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    # -- memory accounting ---------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds, by kind: packed codes, scales/zero-points, descriptors, the
        outlier buffer (baseline only) and the full-precision window."""
        out = {"packed": 0, "scales": 0, "outliers": 0}
        for which in ("k", "v"):
            for name, t in self.store[which].items():
                kind = "packed" if name == "packed" else ("outliers" if name.startswith("sparse") else "scales")
                out[kind] += _nbytes(t)
        out["descriptors"] = self._meta_nbytes()
        out["window"] = _nbytes(self.keys) + _nbytes(self.values) if self.is_initialized else 0
        return out


class InQuantLayer(_WindowedQuantLayer):
    """InQuant: keys and values per channel over ``group_size`` tokens, ``n_outliers`` 8-bit
    channels per kv-head stored in place through donor slots (see ``inquant.py``).

    Descriptors come from ``calibration`` (an ``InQuantCalibration``: calibrated saliency, this
    layer's ``layer_idx``) or, without one, from the first quantized chunk (sampled saliency).
    ``gate``: ``"ratio"`` (first-pass range-ratio gate, ``min_ratio``), ``"score"`` (per-head,
    attention-score error; reconstruction error when there is no calibration to weight it) or
    ``"off"`` (every candidate pair)."""

    layout = "per-channel"

    def __init__(self, group_size: int = 128, n_outliers: int = 4, max_stride: int = 8,
                 n_samples: int = 64, seed: int = 0, backend: str = "auto", min_ratio: float = 15.0,
                 gate: str = "ratio", calibration=None, layer_idx: int = 0):
        if gate not in GATES:
            raise ValueError(f"unknown InQuant gate {gate!r}; choose one of: {', '.join(GATES)}")
        self.n_outliers, self.max_stride, self.n_samples = n_outliers, max_stride, n_samples
        self.min_ratio, self.gate, self.calibration, self.layer_idx = min_ratio, gate, calibration, layer_idx
        self.seed, self.backend = seed, backend
        self.gate_group_size = group_size
        super().__init__(group_size)

    def _clear(self):
        super()._clear()
        self.descriptors: dict[str, Descriptor] = {}
        self._maps: dict = {}
        self._ids: dict = {}

    def _make_descriptors(self, k: torch.Tensor, v: torch.Tensor):
        """Once per cache layer: from the calibration, or from this first chunk."""
        if self.calibration is not None:
            for which in ("k", "v"):
                self.descriptors[which] = self.calibration.descriptor(
                    self.layer_idx, which, self.n_outliers, self.max_stride, self.gate, self.layout,
                    self.gate_group_size, self.min_ratio)
            return
        H = k.shape[1]
        # one saliency pass over keys and values together ([2H, D]), one descriptor per side
        saliency = token_saliency if self.layout == "per-token" else sample_saliency
        sal = saliency(torch.cat([k, v], dim=1), n_samples=self.n_samples, seed=self.seed)
        for i, (which, x) in enumerate((("k", k), ("v", v))):
            side = sal[i * H:(i + 1) * H]
            if self.gate == "ratio" and self.layout == "per-channel":
                self.descriptors[which] = descriptor_from_saliency(side, self.n_outliers, self.max_stride,
                                                                   self.min_ratio)
            else:
                self.descriptors[which] = gated_descriptor(
                    side, self.n_outliers, self.max_stride, self.gate, self.min_ratio, x=x, weight=None,
                    layout=self.layout, group_size=self.gate_group_size, mean=x.float().mean(dim=(0, 2)))

    def _slot_maps(self, sides: str, device, m: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Markers recovered from the descriptors once per layer (and per chunk count ``m``): the
        role/partner of ``sides`` ("k", "v" or "kv": keys then values, ``[2H, D]``) repeated ``m``
        times along the head axis (the ``m`` chunks of a row are quantized as extra heads, without
        transposing). The outlier/donor ids per side are kept under ``self._ids``."""
        key = (sides, m)
        if key not in self._maps:
            roles, partners = [], []
            for which in sides:
                d = self.descriptors[which]
                o, dn, ok = d.outlier_ids.to(device), d.donor_ids.to(device), d.valid.to(device)
                role, partner = role_maps(o, dn, D, ok)
                roles.append(role)
                partners.append(partner)
                self._ids[which] = (o, dn, ok)
            self._maps[key] = (torch.cat(roles).repeat_interleave(m, 0), torch.cat(partners).repeat_interleave(m, 0))
        return self._maps[key]

    def _append(self, k, v, G):
        B, H, n, D = k.shape
        m = n // G
        if not self.descriptors:
            self._make_descriptors(k, v)
        if self.descriptors["k"].outliers.shape[1] == self.descriptors["v"].outliers.shape[1]:
            # keys and values are both grouped per channel and keep as many pairs per head, so one
            # kernel call quantizes both: [B, 2H, m*G, D] viewed as B rows of 2H*m groups of G
            # tokens (outputs come out in the store's layout, keys first)
            batches = [("kv", torch.cat([k, v], dim=1))]
        else:
            batches = [("k", k), ("v", v)]
        for sides, x in batches:
            role, partner = self._slot_maps(sides, x.device, m, D)
            Hx = x.shape[1]
            packed, scale, zero = quantize_pack(x.reshape(B, Hx * m, G, D), role, partner, backend=self.backend)
            packed, scale, zero = packed.view(B, Hx, n, D // 2), scale.view(B, Hx, m, D), zero.view(B, Hx, m, D)
            for i, which in enumerate(sides):
                heads = slice(i * H, (i + 1) * H)
                new = {"packed": packed[:, heads], "scale": scale[:, heads], "zero": zero[:, heads]}
                old = self.store[which]
                self.store[which] = {name: torch.cat([old[name], t], dim=2) if name in old else t
                                     for name, t in new.items()}
        self.group_lens += [G] * m
        self.n_packed += n

    def _dequantize(self, which):
        s = self.store[which]
        if which not in self._ids:
            self._slot_maps(which, s["packed"].device, 1, 2 * s["packed"].shape[-1])
        o, dn, ok = self._ids[which]
        return dequant_unpack(s["packed"], s["scale"], s["zero"], self.group_lens, o, dn,
                              backend=self.backend, valid=ok)

    def _meta_nbytes(self):
        return sum(d.nbytes for d in self.descriptors.values())


class InQuantTokenLayer(InQuantLayer):
    """InQuant with per-token groups (keys and values): every token is quantized when it arrives
    (one bf16 scale/zero per token and kv-head over its normal channels, outliers 8-bit in place),
    so there is no full-precision window: what an append-only cache wants. ``group_size`` is
    used only to look up calibrated descriptors (the gate measures per-token error regardless).
    The PyTorch path only (no Triton kernel for this layout yet).

    Each step reads the whole store back (:func:`_dequant_tokens_into`). ``keep_dequantized=True``
    instead keeps the dequantized prefix in the model's dtype, growing by the new tokens only
    (dequantized once, when quantized): attention reads the same values, decode spends about what
    an unquantized cache does, and the layer holds the packed store *plus* as many bytes as an
    unquantized cache (``nbytes()["dequantized"]``), so it gives up InQuant's memory saving. Off by
    default: at the bench's few-hundred-token contexts it was not faster on CPU (each step's cost is
    then the ~hundreds of small ops that quantize the new token, not the read-back); its O(new tokens)
    step pays at contexts of a thousand tokens and more."""

    layout = "per-token"

    def __init__(self, *args, keep_dequantized: bool = False, **kwargs):
        self.keep_dequantized = keep_dequantized
        super().__init__(*args, **kwargs)
        self.group_size = 1  # the window drains at every update

    def _clear(self):
        super()._clear()
        self._deq: dict[str, torch.Tensor] = {}

    @property
    def _joint(self) -> bool:
        """Keys and values keep as many descriptor columns per head (they do unless built apart)."""
        return self.descriptors["k"].outliers.shape[1] == self.descriptors["v"].outliers.shape[1]

    def _pairs(self, device) -> dict[str, torch.Tensor]:
        """The descriptors as device tensors, built once per layer instead of at every step: keys' and
        values' (outlier, donor, valid) stacked as ``2H`` heads (one quantize call for both sides),
        and per side the flat list of real pairs (padding columns dropped) that dequantization indexes."""
        if "tokens" not in self._maps:
            sides = [self.descriptors[w] for w in ("k", "v")]
            maps = {}
            if self._joint:
                maps = {name: torch.cat([getattr(d, attr).to(device) for d in sides])
                        for name, attr in (("o", "outlier_ids"), ("d", "donor_ids"), ("valid", "valid"))}
            for which, d in zip("kv", sides):
                ok = d.valid.to(device)
                H, k = ok.shape
                heads = torch.arange(H, device=device)[:, None].expand(H, k)[ok]
                fill = torch.zeros(H, k, device=device) if d.fill is None else d.fill.to(device).float()
                chans = torch.cat([d.outlier_ids.to(device)[ok], d.donor_ids.to(device)[ok]])
                maps[which] = {"heads": heads, "heads2": torch.cat([heads, heads]), "chans": chans,
                               "bytes": chans // 2, "high": (chans % 2 == 1)[:, None, None], "fill": fill[ok]}
            self._maps["tokens"] = maps
        return self._maps["tokens"]

    def _append(self, k, v, G):
        if not self.descriptors:
            self._make_descriptors(k, v)
        B, H, n, _ = k.shape
        if self._joint:
            # every group is one (row, head, token): keys and values quantize as 2H heads in one call
            m = self._pairs(k.device)
            packed, scale, zero = quantize_tokens_ref(torch.cat([k, v], dim=1), m["o"], m["d"], m["valid"])
            parts = {"k": (packed[:, :H], scale[:, :H], zero[:, :H]), "v": (packed[:, H:], scale[:, H:], zero[:, H:])}
        else:
            parts = {}
            for which, x in (("k", k), ("v", v)):
                d = self.descriptors[which]
                parts[which] = quantize_tokens_ref(x, d.outlier_ids, d.donor_ids, d.valid)
        for which, (packed, scale, zero) in parts.items():
            old = self.store[which]
            new = {"packed": packed, "scale": scale, "zero": zero}
            self.store[which] = {name: torch.cat([old[name], t], dim=2) if name in old else t.contiguous()
                                 for name, t in new.items()}
            if self.keep_dequantized:  # only the new tokens are dequantized, once
                tail = k.new_empty(B, H, n, k.shape[-1])
                _dequant_tokens_into(packed, scale, zero, self._pairs(k.device)[which], tail)
                self._deq[which] = torch.cat([self._deq[which], tail], dim=2) if which in self._deq else tail
        self.n_packed += n

    def _dequantize(self, which):
        s, d = self.store[which], self.descriptors[which]
        return dequant_tokens_ref(s["packed"], s["scale"], s["zero"], d.outlier_ids, d.donor_ids, d.fill, d.valid)

    def _dequantize_into(self, which, out):
        if self.keep_dequantized:
            out.copy_(self._deq[which])
            return
        s = self.store[which]
        _dequant_tokens_into(s["packed"], s["scale"], s["zero"], self._pairs(out.device)[which], out)

    def _map_batch(self, fn):
        super()._map_batch(fn)
        self._deq = {which: fn(t) for which, t in self._deq.items()}

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        if self.keep_dequantized:  # the copy costs what an unquantized cache of the same tokens holds
            out["dequantized"] = sum(_nbytes(t) for t in self._deq.values())
        return out

    # -- continuous batching: per-token groups can be cut and padded at any column -------------------
    def cut_left(self, first: int) -> None:
        """Drop the first ``first`` token columns of every row (no row attends to them any more)."""
        for which in ("k", "v"):
            self.store[which] = {name: t[:, :, first:] for name, t in self.store[which].items()}
        self._deq = {which: t[:, :, first:] for which, t in self._deq.items()}
        self.n_packed -= first

    def merge_rows(self, other: InQuantTokenLayer, width: int) -> None:
        """Append ``other``'s rows below this layer's, both left-padded with zero columns to ``width``
        tokens (padded columns are masked out by the caller's attention mask). The descriptors must
        be the same (they are when both caches use one calibration)."""
        for which in ("k", "v"):
            a, b = self.descriptors.get(which), other.descriptors.get(which)
            if a is None or b is None or not all(
                    torch.equal(x, y) for x, y in ((a.outliers, b.outliers), (a.offsets, b.offsets))) or (
                    (a.counts is None) != (b.counts is None)) or (a.counts is not None and not torch.equal(a.counts, b.counts)):
                raise ValueError("InQuant caches with different descriptors cannot share a batch "
                                 "(use a calibration so every cache gets the same)")
        if self.keys.shape[-2] or other.keys.shape[-2]:
            raise ValueError("cannot merge rows while tokens wait in a full-precision window")

        def pad(t):
            extra = width - t.shape[2]
            return t if extra == 0 else torch.cat([t.new_zeros(*t.shape[:2], extra, *t.shape[3:]), t], dim=2)

        for which in ("k", "v"):
            self.store[which] = {name: torch.cat([pad(t), pad(other.store[which][name])], dim=0)
                                 for name, t in self.store[which].items()}
        if self.keep_dequantized != other.keep_dequantized:
            raise ValueError("cannot merge InQuant rows with and without a dequantized copy")
        self._deq = {which: torch.cat([pad(t), pad(other._deq[which])], dim=0) for which, t in self._deq.items()}
        self.keys = torch.cat([self.keys, other.keys], dim=0)
        self.values = torch.cat([self.values, other.values], dim=0)
        self.n_packed = width


class KIVILayer(_WindowedQuantLayer):
    """Uniform 4-bit: keys per channel over ``group_size`` tokens, values per token."""

    def _quantize(self, x, which, G):
        B, H, n, D = x.shape
        if which == "v":
            packed, scale, zero = bl.quantize_axis(x, axis=-1)
            return {"packed": packed, "scale": scale[..., 0], "zero": zero[..., 0]}
        m = n // G
        packed, scale, zero = bl.quantize_axis(x.reshape(B, H, m, G, D), axis=-2)
        return {"packed": packed.reshape(B, H, n, D // 2), "scale": scale[:, :, :, 0], "zero": zero[:, :, :, 0]}

    def _dequantize(self, which):
        s = self.store[which]
        if which == "v":
            return bl.dequant_tokens(s["packed"], s["scale"][..., None], s["zero"][..., None])
        return bl.dequant_channels(s["packed"], s["scale"], s["zero"], self.group_lens)


class OutlierBufferLayer(_WindowedQuantLayer):
    """Dense-and-sparse: KIVI-style dense 4-bit plus the top ``outlier_frac`` entries of every
    (row, head, chunk) in an fp16 side buffer with int32 positions."""

    def __init__(self, group_size: int = 128, outlier_frac: float = 0.01):
        self.outlier_frac = outlier_frac
        super().__init__(group_size)

    def _quantize(self, x, which, G):
        B, H, n, D = x.shape
        m = n // G
        # [B, H, m*G, D] viewed as B rows of H*m chunks (no copy): topk per (row, head, chunk)
        mask, vals, idx = bl.split_outliers(x.float().reshape(B, H * m, G, D), self.outlier_frac)
        k = vals.shape[-1]
        # positions become global within the row's sequence: chunk start * D + local position
        start = (self.n_packed + torch.arange(m, device=x.device) * G) * D
        idx = idx.view(B, H, m, k) + start.view(1, 1, m, 1).to(torch.int32)
        vals, idx = vals.view(B, H, m * k), idx.view(B, H, m * k)
        mask = mask.view(B, H, n, D)
        if which == "v":
            packed, scale, zero = bl.quantize_axis(x, axis=-1, mask=mask)
            out = {"packed": packed, "scale": scale[..., 0], "zero": zero[..., 0]}
        else:
            packed, scale, zero = bl.quantize_axis(x.reshape(B, H, m, G, D), axis=-2,
                                                   mask=mask.view(B, H, m, G, D))
            out = {"packed": packed.reshape(B, H, n, D // 2), "scale": scale[:, :, :, 0], "zero": zero[:, :, :, 0]}
        out["sparse_vals"], out["sparse_idx"] = vals.contiguous(), idx.contiguous()
        return out

    def _dequantize(self, which):
        s = self.store[which]
        if which == "v":
            x = bl.dequant_tokens(s["packed"], s["scale"][..., None], s["zero"][..., None])
        else:
            x = bl.dequant_channels(s["packed"], s["scale"], s["zero"], self.group_lens)
        B, H, T, D = x.shape
        x = x.reshape(B, H, T * D).scatter_(-1, s["sparse_idx"].long(), s["sparse_vals"].float())
        return x.view(B, H, T, D)


def _dequant_tokens_into(packed, scale, zero, pairs: dict, out: torch.Tensor) -> None:
    """:func:`dequant_tokens_ref` in fewer passes, written into ``out`` ``[N, H, T, D]``: the nibbles go
    straight into the float result's even/odd channels (no unpacked uint8 copy, no promoting
    ``addcmul``: both measured slower on CPU), scaled and shifted in place; then the real pairs only
    (``pairs`` from ``InQuantTokenLayer._pairs``: padding columns dropped, no per-head loop): one
    gather of their outlier and donor nibbles, their 8-bit values, one ``index_put_`` of outliers
    and donor fills. The float operations are the reference's, so the values are too."""
    if out.dtype != torch.float32:  # computed in float32 and rounded once, as the reference does
        full = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        _dequant_tokens_into(packed, scale, zero, pairs, full)
        out.copy_(full)
        return
    scale, zero = scale.float()[..., None], zero.float()[..., None]
    halves = out.unflatten(-1, (packed.shape[-1], 2))
    halves[..., 0] = packed & 15
    halves[..., 1] = packed >> 4
    out.mul_(scale).add_(zero)
    P = pairs["heads"].shape[0]
    if not P:
        return
    # advanced indices on dims 1 and 3 around a slice: results are [2P, N, T]
    byte = packed[:, pairs["heads2"], :, pairs["bytes"]]
    codes = torch.where(pairs["high"], byte >> 4, byte & 15).float()
    q8 = torch.add(codes[:P], codes[P:], alpha=16)
    sp = scale[..., 0].index_select(1, pairs["heads"]).transpose(0, 1)
    zp = zero[..., 0].index_select(1, pairs["heads"]).transpose(0, 1)
    xo = (q8 - 128.0) * sp + zp
    out[:, pairs["heads2"], :, pairs["chans"]] = torch.cat([xo, pairs["fill"][:, None, None].expand_as(xo)])
