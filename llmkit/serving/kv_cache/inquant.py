"""InQuant's method pieces: sampling-based channel saliency, neighbour-slot donors, descriptors.

Paper: "InQuant: in-place mixed-precision KV-cache quantization" (NeurIPS 2026).
The packed format and the kernels live in ``llmkit.kernels.kv_quant``; this module decides, per
layer and kv-head, which channels are outliers (8-bit) and whose 4-bit slot each one borrows.

Algorithm (per layer, separately for keys and values, once, on the first chunk that is quantized):

1. Saliency by sampling: each channel's range (max - min) over ``n_samples`` seeded random token
   positions. The range sets a channel's 4-bit step and bounds the error of replacing it by its mean
   (the donor's cost), so one number ranks both ends.
2. Outliers: the ``k`` channels of highest saliency per kv-head.
3. Neighbour-slot reuse: each outlier, most salient first, takes as donor the lowest-saliency free
   channel within ``max_stride`` positions (nearest wins ties; the search widens stride by stride, and
   only if the whole window is taken falls back to the head's lowest-saliency free channel). The donor's
   slot stores the outlier's high nibble; the donor is read back as its per-group mean.
4. Gate: ``gate="ratio"`` (``worthwhile_pairs``) keeps a pair only when the outlier's range is at least
   ``min_ratio`` (15) times its donor's (below that 8 bits gain less than the donor loses); when no pair
   can pass, the donor search is skipped (same descriptor). ``gate="score"`` (``gated_descriptor``) keeps,
   per head, the ``c`` most salient pairs with ``c`` minimising the error ``e^T W e`` of a quantize /
   dequantize round trip on calibration data, ``W = E[q q^T]`` for keys (the error of the logits q.k) and
   the output projection's ``W_o^T W_o`` for values. ``gate="off"`` keeps every candidate pair.
5. Descriptor: per head, the outlier ids (uint8) and signed donor offsets (int8), ``2k`` bytes;
   ``Descriptor.counts`` lets each kv-head keep its own number of pairs (padding columns are inert).
   Dequantization recovers the per-slot roles from it (``llmkit.kernels.kv_quant.role_maps``).

Calibration (``calibration.py``): one pass over a few texts gives per-layer saliency, channel means, the
score gate's weights and sample keys/values, saved beside the model; the in-prompt sampling above is the
fallback without one. Per-token groups (``layout="per-token"``, ``kv_quant.quantize_tokens_ref``) are the
layout where an outlier costs the most (it sets the step of every channel of its token); saliency there is
a channel's deviation from its token's median channel (``token_saliency``), donors read back as their
calibrated mean, and tokens are stored on arrival (no full-precision window). Measured settings and
baselines: bench/results/kv_cache.md.

Deviations from the paper (we only have its abstract): the saliency statistics (sampled range;
per-token deviation), the donor approximation (group mean; calibrated mean), the donor search
rule, the gates and the descriptor encoding are our choices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@functools.lru_cache(maxsize=64)
def _sample_positions(T: int, n_samples: int, seed: int) -> torch.Tensor:
    """``n_samples`` distinct token positions of ``T``, sorted, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(T, generator=g)[:n_samples].sort().values


def sample_saliency(x: torch.Tensor, n_samples: int = 64, seed: int = 0) -> torch.Tensor:
    """Per-(head, channel) saliency ``[H, D]`` from ``n_samples`` random token positions of
    ``x [B, H, T, D]``: the channel's range over the sampled tokens (all rows of the batch)."""
    T = x.shape[-2]
    if T > n_samples:
        x = x.index_select(-2, _sample_positions(T, n_samples, seed).to(x.device))
    x = x.float()
    return (x.amax(dim=(0, 2)) - x.amin(dim=(0, 2)))


def token_saliency(x: torch.Tensor, n_samples: int = 64, seed: int = 0) -> torch.Tensor:
    """Per-(head, channel) saliency ``[H, D]`` for per-token groups: the largest deviation of the
    channel from its token's median channel over ``n_samples`` sampled tokens. In a per-token
    group what widens the step is a channel far from the others *within the token* (a
    persistent offset counts, which a range over tokens cannot see)."""
    T = x.shape[-2]
    if T > n_samples:
        x = x.index_select(-2, _sample_positions(T, n_samples, seed).to(x.device))
    x = x.float()
    return (x - x.median(-1, keepdim=True).values).abs().amax(dim=(0, 2))


def select_outliers(saliency: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most salient channels per head, ``[H, k]`` (sorted by channel id)."""
    if k == 0:
        return torch.zeros(saliency.shape[0], 0, dtype=torch.long, device=saliency.device)
    return saliency.topk(k, dim=-1).indices.sort(dim=-1).values


def assign_donors(saliency: torch.Tensor, outliers: torch.Tensor, max_stride: int = 4) -> torch.Tensor:
    """A donor channel per outlier, ``[H, k]``: the lowest-saliency free channel within
    ``max_stride`` of the outlier (nearer stride wins ties); no channel lends twice, no outlier lends."""
    H, D = saliency.shape
    if 2 * outliers.shape[-1] > D:
        raise ValueError(f"{outliers.shape[-1]} outliers per head need as many donor channels; head_dim is {D}")
    sal = saliency.detach().float().cpu().tolist()  # plain lists: this loop is tiny but per-element
    out = outliers.cpu().tolist()
    donors = []
    for h in range(H):
        s, taken, mine = sal[h], set(out[h]), [0] * len(out[h])
        for i in sorted(range(len(out[h])), key=lambda i: -s[out[h][i]]):
            c = out[h][i]
            window = [c + st * sign for st in range(1, max_stride + 1) for sign in (-1, 1)]
            cands = [d for d in window if 0 <= d < D and d not in taken]
            if not cands:  # a run of outliers wider than the stride window
                cands = [d for d in range(D) if d not in taken]
            # min over (saliency, distance): the least salient neighbour, the nearest on ties
            d = min(cands, key=lambda d: (s[d], abs(d - c)))
            mine[i] = d
            taken.add(d)
        donors.append(mine)
    donors = torch.tensor(donors, dtype=torch.long).view(H, len(out[0]) if out else 0)
    return donors.to(outliers.device)


@dataclass
class Descriptor:
    """Compact per-head slot descriptor: outlier channel ids and signed offsets to their donors.

    Heads may keep different numbers of pairs (``counts [H]``, the first ``counts[h]`` columns
    of head ``h`` are its pairs): one head's verdict never limits another's. The other columns
    are padding (a normal channel as its own donor, offset 0). ``fill [H, k]`` (per-token layout
    only) is the value each donor channel is read back as."""

    outliers: torch.Tensor  # uint8 [H, k]
    offsets: torch.Tensor  # int8 [H, k]
    counts: torch.Tensor | None = None  # uint8 [H]; None = every column used
    fill: torch.Tensor | None = None  # bf16 [H, k]

    @classmethod
    def build(cls, outliers: torch.Tensor, donors: torch.Tensor, counts: torch.Tensor | None = None,
              fill: torch.Tensor | None = None, head_dim: int | None = None) -> Descriptor:
        outliers, donors = outliers.long(), donors.long()
        H, k = outliers.shape
        if counts is not None:
            counts = counts.long().clamp(0, k)
            valid = torch.arange(k, device=outliers.device)[None, :] < counts[:, None]
            if not bool(valid.all()):
                D = head_dim or (int(torch.cat([outliers, donors], 1).max()) + 2 if k else 1)
                used = torch.zeros(H, D, dtype=torch.bool, device=outliers.device)
                used.scatter_(1, torch.where(valid, outliers, outliers[:, :1]), valid)
                used.scatter_(1, torch.where(valid, donors, donors[:, :1]), valid)
                pad = (~used).to(torch.int8).argmax(1, keepdim=True).expand(H, k)
                outliers, donors = torch.where(valid, outliers, pad), torch.where(valid, donors, pad)
            counts = counts.to(torch.uint8)
        off = donors - outliers
        if off.numel() and (off.abs().max() > 127 or outliers.max() > 255):
            raise ValueError("descriptor needs head_dim <= 256 and donor offsets within int8")
        if fill is not None:
            fill = fill.to(torch.bfloat16)
        return cls(outliers.to(torch.uint8), off.to(torch.int8), counts, fill)

    @property
    def outlier_ids(self) -> torch.Tensor:
        return self.outliers.long()

    @property
    def donor_ids(self) -> torch.Tensor:
        return self.outliers.long() + self.offsets.long()

    @property
    def valid(self) -> torch.Tensor:
        """``[H, k]`` bool: which columns are real pairs."""
        H, k = self.outliers.shape
        if self.counts is None:
            return torch.ones(H, k, dtype=torch.bool, device=self.outliers.device)
        return torch.arange(k, device=self.outliers.device)[None, :] < self.counts.long()[:, None]

    @property
    def pairs_per_head(self) -> torch.Tensor:
        """``[H]`` long: pairs each head uses."""
        return self.valid.sum(1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.outliers, self.offsets, self.counts, self.fill)
                   if t is not None)

    def index_select_heads(self, heads):
        return Descriptor(self.outliers[heads], self.offsets[heads],
                          None if self.counts is None else self.counts[heads],
                          None if self.fill is None else self.fill[heads])


def worthwhile_pairs(saliency: torch.Tensor, outliers: torch.Tensor, donors: torch.Tensor,
                     min_ratio: float = 15.0) -> torch.Tensor:
    """Keep the (outlier, donor) pairs whose reuse lowers the expected error: with range r, a
    4-bit channel errs ~r/15 per step and a mean-approximated donor ~r, so a pair pays only when
    ``r_outlier > min_ratio * r_donor``. Pairs are kept most salient first; all heads keep the same
    count (the smallest), so descriptors stay rectangular. Returns the kept columns, ``[H, k']``."""
    so, sd = saliency.gather(1, outliers), saliency.gather(1, donors)
    order = so.argsort(dim=1, descending=True)
    ok = so.gather(1, order) > min_ratio * sd.gather(1, order)
    k = int(ok.long().cumprod(1).sum(1).min()) if ok.numel() else 0
    return order[:, :k].sort(dim=1).values


def estimate_descriptor(x: torch.Tensor, n_outliers: int = 4, max_stride: int = 8,
                        n_samples: int = 64, seed: int = 0, min_ratio: float = 15.0) -> Descriptor:
    """Steps 1-5 on ``x [B, H, T, D]`` (``min_ratio=0`` keeps all ``n_outliers`` pairs)."""
    return descriptor_from_saliency(sample_saliency(x, n_samples=n_samples, seed=seed), n_outliers,
                                    max_stride, min_ratio)


def descriptor_from_saliency(sal: torch.Tensor, n_outliers: int = 4, max_stride: int = 8,
                             min_ratio: float = 15.0) -> Descriptor:
    """Steps 2-5 from a saliency ``[H, D]`` (see :func:`estimate_descriptor`)."""
    H, D = sal.shape
    if 2 * n_outliers > D:
        raise ValueError(f"{n_outliers} outliers per head need as many donor channels; head_dim is {D}")
    if n_outliers == 0 or (min_ratio > 0 and bool((sal.amax(1) <= min_ratio * sal.amin(1)).any())):
        # exact shortcut: in some head even the most salient channel is within min_ratio of the
        # least salient one, so its first pair cannot pass the gate and (all heads keeping the
        # same count) no pair is kept anywhere: skip the donor search
        empty = torch.zeros(H, 0, dtype=torch.long, device=sal.device)
        return Descriptor.build(empty, empty)
    out = select_outliers(sal, n_outliers)
    don = assign_donors(sal, out, max_stride=max_stride)
    keep = worthwhile_pairs(sal, out, don, min_ratio)
    return Descriptor.build(out.gather(1, keep), don.gather(1, keep))


# ----------------------------------------------------------------------------- attention-score gate

GATES = ("off", "ratio", "score")
LAYOUTS = ("per-channel", "per-token")


def candidate_pairs(sal: torch.Tensor, n_outliers: int, max_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-4: the ``n_outliers`` most salient channels per head and their donors, both ``[H, n]``,
    ordered most salient first (so "the first ``c`` columns" is "the ``c`` most salient pairs")."""
    D = sal.shape[1]
    if 2 * n_outliers > D:
        raise ValueError(f"{n_outliers} outliers per head need as many donor channels; head_dim is {D}")
    out = select_outliers(sal, n_outliers)
    don = assign_donors(sal, out, max_stride=max_stride)
    order = sal.gather(1, out).argsort(dim=1, descending=True)
    return out.gather(1, order), don.gather(1, order)


def round_trip(x: torch.Tensor, desc: Descriptor, layout: str, group_size: int) -> torch.Tensor:
    """Quantize and dequantize ``x [B, H, T, D]`` with ``desc`` in ``layout`` (PyTorch path).
    Per channel, ``T`` is cut to whole groups of ``group_size`` (one group when ``T`` is shorter)."""
    from llmkit.kernels import kv_quant as kq

    B, H, T, D = x.shape
    o, d, valid = desc.outlier_ids.to(x.device), desc.donor_ids.to(x.device), desc.valid.to(x.device)
    if layout == "per-token":
        packed, scale, zero = kq.quantize_tokens_ref(x, o, d, valid)
        return kq.dequant_tokens_ref(packed, scale, zero, o, d, desc.fill, valid)
    if layout != "per-channel":
        raise ValueError(f"unknown InQuant layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    G = min(group_size, T)
    m = T // G
    x = x[..., :m * G, :]
    role, partner = kq.role_maps(o, d, D, valid)
    packed, scale, zero = kq.quantize_pack_ref(x.reshape(B, H * m, G, D), role.repeat_interleave(m, 0),
                                               partner.repeat_interleave(m, 0))
    return kq.dequant_unpack_ref(packed.view(B, H, m * G, D // 2), scale.view(B, H, m, D), zero.view(B, H, m, D),
                                 [G] * m, o, d, valid=valid)


def weighted_error(x: torch.Tensor, xq: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Mean over rows and tokens of ``e^T W_h e`` per head (``e = xq - x``), ``[H]``. For keys with
    ``W_h = E[q q^T]`` over the queries that read head ``h`` this is the mean squared error of the
    attention logits ``q.k``; ``None`` = plain squared reconstruction error."""
    x = x[..., :xq.shape[-2], :].float()
    e = xq.float() - x
    if weight is None:
        return e.pow(2).sum(-1).mean(dim=(0, 2))
    return torch.einsum("bhtd,hde,bhte->h", e, weight.to(e.device).float(), e) / (e.shape[0] * e.shape[2])


def score_gate_counts(x: torch.Tensor, outliers: torch.Tensor, donors: torch.Tensor, weight: torch.Tensor | None,
                      layout: str, group_size: int, fill: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention-score gate: for each head, how many of its candidate pairs (most salient
    first) to keep, chosen as the count ``c in 0..n`` that minimises :func:`weighted_error` of
    ``x`` after a round trip; each head decides alone. Returns ``(counts [H], errors [n+1, H])``."""
    H, n = outliers.shape
    errs = []
    for c in range(n + 1):
        desc = Descriptor.build(outliers, donors, torch.full((H,), c), fill, head_dim=x.shape[-1])
        errs.append(weighted_error(x, round_trip(x, desc, layout, group_size), weight))
    errs = torch.stack(errs)
    return errs.argmin(0), errs  # argmin returns the first minimum: fewer pairs on ties


def gated_descriptor(sal: torch.Tensor, n_outliers: int = 4, max_stride: int = 8, gate: str = "score",
                     min_ratio: float = 15.0, x: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     layout: str = "per-channel", group_size: int = 128,
                     mean: torch.Tensor | None = None) -> Descriptor:
    """A per-head descriptor from saliency ``sal [H, D]`` with one of three gates:

    - ``"off"``: every candidate pair is kept (the paper's unconditional reuse);
    - ``"ratio"``: the first pass's range-ratio gate (:func:`worthwhile_pairs`, one count for all heads);
    - ``"score"``: :func:`score_gate_counts` on sample data ``x [B, H, T, D]`` weighted by ``weight``
      (``[H, D, D]``; for keys the query second moments, so the criterion is the q.k error).

    ``mean [H, D]`` gives the per-token layout's donor fill values (zeros when ``None``)."""
    if gate not in GATES:
        raise ValueError(f"unknown InQuant gate {gate!r}; choose one of: {', '.join(GATES)}")
    H, D = sal.shape
    if n_outliers == 0:
        empty = torch.zeros(H, 0, dtype=torch.long, device=sal.device)
        return Descriptor.build(empty, empty)
    out, don = candidate_pairs(sal, n_outliers, max_stride)
    fill = None
    if layout == "per-token":
        fill = (mean if mean is not None else torch.zeros_like(sal)).to(sal.device).float().gather(1, don)
    if gate == "off":
        counts = torch.full((H,), n_outliers)
    elif gate == "ratio":
        counts = torch.full((H,), worthwhile_pairs(sal, out, don, min_ratio).shape[1])
    else:
        if x is None:
            raise ValueError("the score gate needs sample keys/values (x) to measure the error on")
        counts, _ = score_gate_counts(x, out, don, weight, layout, group_size, fill)
    return Descriptor.build(out, don, counts, fill, head_dim=D)
