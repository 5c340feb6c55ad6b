"""Fused low-rank Rademacher perturbation for zeroth-order finetuning: ``W + alpha * U V^T / sqrt(r)``.

A workbench kernel (issue 18), not yet wired into ``llmkit/optim/zo.py``: nothing in the optimizer
imports it. It is verified against zo.py's reference semantics for LQZO-style ZO, where each step
perturbs a weight (or scale) matrix by a low-rank direction ``z = U V^T / sqrt(r)`` with Rademacher
(+-1) factors ``U [m, r]``, ``V [n, r]`` (``zo.direction(..., rank=r, distribution="rademacher")``;
every entry of ``z`` has mean 0 and variance 1), additively (``x0 + s mu z``) or relatively
(``x0 (1 + s mu z)``), evaluates the loss at ``W + mu z`` and ``W - mu z``, and restores ``W``
(``tests/test_kernels_workbench.py`` checks the kernel against ``zo.direction`` with the same seeds,
and against :func:`perturb_ref`). The PyTorch reference materializes ``z`` (an ``m x n`` temporary,
then a second full pass for the add); the Triton kernel never does: each program loads one
``[BM, BN]`` tile of ``W`` and the matching rows of ``U`` and ``V`` (``r`` values each: int8
signs, or the +-1 floats ``zo.sample`` returns), forms the tile of ``U V^T`` with one small ``tl.dot`` in registers, and writes
``W + alpha * z`` (``mode="add"``) or ``W * (1 + alpha * z)`` (``mode="mul"``: relative
perturbation, used for quantization scales) back. One read and one write of ``W``; in place when
``out is w``.

Hawkeye strategy tags (what the workbench finds in the compiled code): ``tl.dot`` on the factor tiles
(tensor-core MMA on every target: mma_sync / wgmma / tcgen05_mma / mfma), vectorized 128-bit
accesses of ``W``. The rank dimension is padded to 16 inside the kernel (``tl.dot`` needs K >= 16);
sums of +-1 products are exact in bf16 operands with fp32 accumulation.

``U``/``V`` come from the caller (drawn as ``zo.direction`` draws them: ``zo.sample(..., "rademacher")``
from the step's seeds), so the perturbation is reproducible from seeds exactly as zo.py's.
Importing this module imports triton (the kernel must be a module global): import it lazily, where
the perturbation is applied.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MODES = ("add", "mul")


def rademacher(shape, seed: int, device=None) -> torch.Tensor:
    """+-1 int8 signs from a seed (a helper for tests and callers without their own sampler)."""
    g = torch.Generator(device=device or "cpu").manual_seed(int(seed))
    return (torch.randint(0, 2, tuple(shape), generator=g, device=device, dtype=torch.int8) * 2 - 1).to(torch.int8)


def perturb_ref(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, alpha: float, mode: str = "add") -> torch.Tensor:
    """``w + alpha * (u @ v.T) / sqrt(r)`` (or ``w * (1 + alpha * ...)``), computed in float32, cast to w's dtype."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    z = (u.float() @ v.float().T) / math.sqrt(u.shape[1])
    wf = w.float()
    out = wf + alpha * z if mode == "add" else wf * (1.0 + alpha * z)
    return out.to(w.dtype)


@triton.jit
def lowrank_perturb_kernel(w_ptr, u_ptr, v_ptr, out_ptr, M, N, R, alpha, inv_sqrt_r,
                           BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, MUL: tl.constexpr):
    """One [BM, BN] tile of W: z = (U_tile @ V_tile^T) / sqrt(r) in registers, then W + alpha z (or W (1 + alpha z))."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rr = tl.arange(0, BR)
    u = tl.load(u_ptr + rm[:, None] * R + rr[None, :], mask=(rm[:, None] < M) & (rr[None, :] < R), other=0)
    vt = tl.load(v_ptr + rn[None, :] * R + rr[:, None], mask=(rn[None, :] < N) & (rr[:, None] < R), other=0)
    z = tl.dot(u.to(tl.bfloat16), vt.to(tl.bfloat16)) * inv_sqrt_r  # sums of +-1: exact
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MUL:
        y = w * (1.0 + alpha * z)
    else:
        y = w + alpha * z
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def perturb_triton(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, alpha: float, mode: str = "add",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`perturb_ref`; ``out=w`` perturbs in place. ``w`` 2-D contiguous."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if w.dim() != 2 or not w.is_contiguous():
        raise ValueError("w must be a contiguous 2-D tensor (reshape a weight to its matrix view first)")
    M, N = w.shape
    R = u.shape[1]
    if u.shape != (M, R) or v.shape != (N, R):
        raise ValueError(f"factor shapes {tuple(u.shape)}, {tuple(v.shape)} do not match w {tuple(w.shape)}")
    out = torch.empty_like(w) if out is None else out
    BM, BN = 64, 64
    BR = max(16, triton.next_power_of_2(R))
    lowrank_perturb_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        w, u.contiguous(), v.contiguous(), out, M, N, R, float(alpha), 1.0 / math.sqrt(R),
        BM=BM, BN=BN, BR=BR, MUL=mode == "mul")
    return out


def perturb(w, u, v, alpha: float, mode: str = "add", backend: str = "auto") -> torch.Tensor:
    """Dispatch: the kernel on CUDA tensors (or ``backend="triton"``), else the reference."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; choose auto, torch or triton")
    if backend == "triton" or (backend == "auto" and w.is_cuda):
        return perturb_triton(w, u, v, alpha, mode)
    return perturb_ref(w, u, v, alpha, mode)
