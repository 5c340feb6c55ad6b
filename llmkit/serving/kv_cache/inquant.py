"""InQuant's method pieces: sampling-based channel saliency, neighbour-slot donors, descriptors.

Paper: "InQuant: in-place mixed-precision KV-cache quantization" (../shared/seeds/004_ead6308da16bc4ed.txt).
The packed format and the kernels live in ``llmkit.kernels.kv_quant``; this module decides, per
layer and kv-head, which channels are outliers (8-bit) and whose 4-bit slot each one borrows.

Algorithm (per layer, separately for keys and values, once, on the first chunk that is quantized):

1. Saliency by sampling: draw ``n_samples`` token positions at random (seeded) and take each
   channel's range (max - min) over them. The range is what sets a channel's 4-bit step (its
   quantization error) and bounds the error of approximating it by its mean (the donor's cost),
   so one number ranks both ends.
2. Outliers: the ``k`` channels of highest saliency per kv-head.
3. Neighbour-slot reuse: each outlier, most salient first, takes as donor the lowest-saliency free
   channel within ``max_stride`` positions of it (nearest wins ties). The donor's slot stores the
   outlier's high nibble; the donor itself is approximated by its per-group mean (stored in its
   zero-point, scale 0).
4. Adjacent outliers: when the immediate neighbours are outliers or already lend their slot, the
   search widens stride by stride (±1, ±2, ... ±max_stride); only if the whole window is taken
   does it fall back to the lowest-saliency free channel of the head.
5. Only worthwhile pairs are kept (``worthwhile_pairs``): an outlier whose range is less than
   ``min_ratio`` (15) times its donor's gains less from 8 bits than the donor loses by being
   replaced with its mean. On SmolLM2-135M the channel ranges of a head differ by only ~4-15x, so
   this gate turns most pairs off there and InQuant falls back to uniform per-channel 4-bit.
6. Descriptor: per head, the outlier ids (uint8) and signed donor offsets (int8), ``2k`` bytes.
   At dequantization the per-slot markers (role of each slot, partner of each marked slot) are
   recovered from it (``llmkit.kernels.kv_quant.role_maps``).

Cost: the saliency pass and descriptor run once per cache layer (keys and values sampled in one
pass); when the gate can keep no pair (some head's channel ranges are all within ``min_ratio``)
the donor search is skipped, which gives exactly the descriptor the full search would.

Deviations from the paper (we only have its abstract): the saliency statistic (sampled range), the
donor approximation (group mean), the donor search rule and the descriptor encoding are our
choices; saliency is estimated once per cache from the first quantized chunk rather than from an
offline calibration set, so nothing needs calibrating before serving.
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
    """Compact per-head slot descriptor: outlier channel ids and signed offsets to their donors."""

    outliers: torch.Tensor  # uint8 [H, k]
    offsets: torch.Tensor  # int8 [H, k]

    @classmethod
    def build(cls, outliers: torch.Tensor, donors: torch.Tensor) -> Descriptor:
        off = donors.long() - outliers.long()
        if off.numel() and (off.abs().max() > 127 or outliers.max() > 255):
            raise ValueError("descriptor needs head_dim <= 256 and donor offsets within int8")
        return cls(outliers.to(torch.uint8), off.to(torch.int8))

    @property
    def outlier_ids(self) -> torch.Tensor:
        return self.outliers.long()

    @property
    def donor_ids(self) -> torch.Tensor:
        return self.outliers.long() + self.offsets.long()

    @property
    def nbytes(self) -> int:
        return self.outliers.numel() * self.outliers.element_size() + self.offsets.numel() * self.offsets.element_size()

    def index_select_heads(self, heads):
        return Descriptor(self.outliers[heads], self.offsets[heads])


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
