"""Group-wise INT4 / INT2 weight quantization with trainable scales (our own small quantizer).

Why our own and not optimum-quanto or bitsandbytes: QZO/LQZO train the per-group *scales* while the
integer codes stay frozen, so the forward must read the scales as an ordinary float tensor that the ZO
engine can perturb in place, and the codes must never be re-derived from the weights. bitsandbytes'
NF4 stores absmax scales inside its own packed state (and has no INT2), optimum-quanto's packed
WeightQBitsTensor recomputes its layout on assignment; both would need private-attribute surgery.
A quantizer of ~100 lines with a plain layout is easier to trust and to test:

* ``codes``: uint8 buffer ``(out, in)`` holding integers in ``[0, 2^bits - 1]`` (one code per byte:
  simple and fast to dequantize; packing 2 or 4 codes per byte would cut code memory 2-4x and is left
  out), frozen.
* ``zero``: float buffer ``(out, in / group)``, an integer-valued zero point per group, frozen.
* ``scale``: float32 ``nn.Parameter`` ``(out, in / group)``, the trainable set (float32 even in a bf16
  model: a relative perturbation of 1e-3 is below bf16's resolution).
* ``W = (codes - zero) * scale`` per group, dequantized on the fly in each forward (the dense weight
  is a temporary of one layer at a time, as in inference kernels without fused dequantization).

Initial scales: asymmetric min-max per group, with a grid search over range shrink factors
(0.6 .. 1.0) that minimises each group's squared error; at 2 bits this matters (plain min-max
wastes most of the 4 levels on outliers).

``dequantized_state_dict`` gives a normal HF state dict (``*.weight`` dense), so a trained model saves
as an ordinary checkpoint; ``quant_state`` / ``load_quant_state`` carry codes, zeros and scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QUANT_FILE = "lqzo_quant.safetensors"
QUANT_CONFIG = "lqzo_quant.json"
DEFAULT_SKIP = ("lm_head", "embed_tokens")


class QuantLinear(nn.Module):
    """A linear layer whose weight is ``(codes - zero) * scale`` with group-wise scales along the input dim."""

    def __init__(self, codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 bits: int, group_size: int):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.bits, self.group_size = int(bits), int(group_size)
        self.register_buffer("codes", codes.to(torch.uint8))
        self.register_buffer("zero", zero)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        g = self.group_size
        w = self.codes.view(self.out_features, -1, g).to(self.scale.dtype, copy=True)
        # in place on that fresh copy: the same numbers as ``(w - zero) * scale`` without a second
        # weight-sized temporary (on CPU the out-of-place broadcast subtraction cost more than the rest)
        w.sub_(self.zero.unsqueeze(-1)).mul_(self.scale.unsqueeze(-1))
        w = w.view(self.out_features, self.in_features)
        return w if dtype is None else w.to(dtype)

    @property
    def weight(self) -> torch.Tensor:  # for code that reads .weight (dtype/device probes, tied checks)
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}")


@torch.no_grad()
def quantize_weight(w: torch.Tensor, bits: int, group_size: int,
                    shrink_grid: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7, 0.6),
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8, zero, scale)`` for a 2-D weight; groups of ``group_size`` along the input dim."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits must be 2, 3, 4 or 8, got {bits}")
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {in_f}")
    qmax = 2 ** bits - 1
    wg = w.detach().float().view(out_f, in_f // group_size, group_size)
    lo_full, hi_full = wg.amin(-1), wg.amax(-1)
    best_err = best_scale = best_zero = None
    for a in shrink_grid:
        lo = torch.minimum(lo_full * a, torch.zeros_like(lo_full))
        hi = torch.maximum(hi_full * a, torch.zeros_like(hi_full))
        scale = ((hi - lo) / qmax).clamp_min(1e-8)
        zero = torch.round(-lo / scale).clamp(0, qmax)
        q = torch.clamp(torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, qmax)
        err = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - wg).pow(2).sum(-1)
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    codes = torch.clamp(torch.round(wg / best_scale.unsqueeze(-1)) + best_zero.unsqueeze(-1), 0, qmax)
    return codes.view(out_f, in_f).to(torch.uint8), best_zero.float(), best_scale.float()


def _pick_group(in_features: int, group_size: int) -> int:
    return group_size if in_features % group_size == 0 else in_features


def quantizable(name: str, module: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP) -> bool:
    return isinstance(module, nn.Linear) and not any(s in name.split(".") or name.endswith(s) for s in skip)


@torch.no_grad()
def quantize_model(model: nn.Module, bits: int, group_size: int, skip: tuple[str, ...] = DEFAULT_SKIP,
                   progress: bool = False) -> list[str]:
    """Replace every ``nn.Linear`` (except ``skip``: LM head and embeddings) by a ``QuantLinear``, in place.

    A layer whose input size the group does not divide gets one group per row. Returns the module names.
    """
    names = [n for n, m in model.named_modules() if quantizable(n, m, skip)]
    it = names
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(names, desc=f"quantizing to INT{bits}", leave=False)
    for name in it:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        g = _pick_group(lin.in_features, group_size)
        codes, zero, scale = quantize_weight(lin.weight.data, bits, g)
        setattr(parent, child, QuantLinear(codes, zero, scale, lin.bias, bits, g))
    return names


def quant_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


@torch.no_grad()
def dequantized_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A plain HF state dict: each QuantLinear contributes ``<name>.weight`` (dense) and its bias."""
    qmods = quant_modules(model)
    sd = {}
    for k, v in model.state_dict().items():
        mod, _, _leaf = k.rpartition(".")
        if mod in qmods:
            continue
        sd[k] = v
    for n, m in qmods.items():
        sd[f"{n}.weight"] = m.dequantize(dtype)
        if m.bias is not None:
            sd[f"{n}.bias"] = m.bias.data
    return sd


def quant_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors (codes, zero, scale per module) and a JSON-able description (bits, group size per module)."""
    tensors, meta = {}, {}
    for n, m in quant_modules(model).items():
        tensors[f"{n}.codes"] = m.codes.contiguous()
        tensors[f"{n}.zero"] = m.zero.contiguous()
        tensors[f"{n}.scale"] = m.scale.data.contiguous()
        meta[n] = {"bits": m.bits, "group_size": m.group_size}
    return tensors, meta


@torch.no_grad()
def load_quant_state(model: nn.Module, tensors: dict[str, torch.Tensor], meta: dict) -> list[str]:
    """Install saved QuantLinears into ``model`` (dense Linears replaced, existing QuantLinears overwritten)."""
    for name, info in meta.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if isinstance(old, QuantLinear) and old.scale.shape == tensors[f"{name}.scale"].shape:
            old.codes.copy_(tensors[f"{name}.codes"])  # in place: optimizers keep their references
            old.zero.copy_(tensors[f"{name}.zero"])
            old.scale.data.copy_(tensors[f"{name}.scale"])
            continue
        ref = old.scale if isinstance(old, QuantLinear) else old.weight
        bias = old.bias
        codes = tensors[f"{name}.codes"].to(ref.device)
        zero = tensors[f"{name}.zero"].to(device=ref.device, dtype=torch.float32)
        scale = tensors[f"{name}.scale"].to(device=ref.device, dtype=torch.float32)
        setattr(parent, child, QuantLinear(codes, zero, scale, bias, info["bits"], info["group_size"]))
    return list(meta)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the tensors the model holds, split by role (codes, zeros, scales, other params/buffers)."""
    out = {"codes": 0, "zero": 0, "scale": 0, "other": 0}
    seen = set()
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        leaf = n.rpartition(".")[2]
        key = leaf if leaf in ("codes", "zero", "scale") else "other"
        out[key] += t.numel() * t.element_size()
    out["total"] = sum(out.values())
    return out
