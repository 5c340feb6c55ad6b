"""Expert-written example kernels for the Hawkeye strategy tests, each with its deliberate twin.

Every strategy test in ``kernels/strategies/<arch>/test_<strategy>.py`` launches one kernel from
here (the strategy done right) and one "broken" variant (the same computation without the
strategy, or with the strategy done wrong), then checks correctness against the PyTorch
reference and the strategy's presence in the code compiled for its architecture. Kernels are
shared across architectures where the *source* is the same (a ``tl.dot`` loop is one source; the
compiler turns it into ``mma.sync``, ``wgmma``, ``tcgen05.mma`` or ``v_mfma``): the per-arch
test decides what the compiled code must show.

Shapes are multiples of the tile sizes (no masks), row-major contiguous, so that pointer
divisibility is known to the compiler; callers keep them small (Triton's interpreter runs them on
CPU). The ``run_*`` functions return ``(out, expected)`` and are what the tests call. Their
kernel arguments live where the launch runs (:func:`~.compiled.launch_device`): CPU tensors
under the interpreter, ``cuda`` tensors when :func:`~.check.check_strategy` launches natively on
a GPU of the test's own architecture; inputs are drawn and references computed on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compiled import launch_device

# ------------------------------------------------------------------------------------ kernels


@triton.jit
def matmul_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  ACC: tl.constexpr = tl.float32):
    """C = A @ B with tl.dot: tensor-core MMA on every target (mma.sync / wgmma / tcgen05 / mfma)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), ACC)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def matmul_fma_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      ACC: tl.constexpr = tl.float32):
    """The same product as broadcast multiply + sum: right, but on CUDA/vector cores (no MMA)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), ACC)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :]).to(ACC)
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :]).to(ACC)
        acc += tl.sum(x[:, :, None] * y[None, :, :], 1)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def matmul_upcast_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Low-precision inputs widened to bf16 before tl.dot: the MMA runs at 16-bit rate."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :]).to(tl.bfloat16)
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :]).to(tl.bfloat16)
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def matmul_bias_gelu_kernel(a, b, bias, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            FUSE: tl.constexpr):
    """Epilogue fusion: bias + tanh-GELU applied to the accumulator in registers before the one store.

    FUSE=False is the broken twin (stores the raw product; the epilogue would need another pass)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    if FUSE:
        acc += tl.load(bias + rn)[None, :].to(tl.float32)
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)  # tanh is +-1 there; keeps exp finite
        acc = 0.5 * acc * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def splitk_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT: tl.constexpr, ATOMIC: tl.constexpr):
    """Split-K: program (tile, s) reduces K-slice s; partial tiles meet by fp32 atomic adds.

    ATOMIC=False is the broken twin: plain stores, so the slices overwrite each other."""
    pid, s = tl.program_id(0), tl.program_id(1)
    npn = N // BN
    pm, pn = pid // npn, pid % npn
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    kslice = K // SPLIT
    for k in range(s * kslice, (s + 1) * kslice, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    ptrs = c + rm[:, None] * N + rn[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, sem="relaxed")
    else:
        tl.store(ptrs, acc)


@triton.jit
def persistent_matmul_kernel(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Persistent kernel: a grid of (at most) one program per SM walks the output tiles."""
    npn = N // BN
    num_tiles = (M // BM) * npn
    rk = tl.arange(0, BK)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        rm = (tile // npn) * BM + tl.arange(0, BM)
        rn = (tile % npn) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
            y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
            acc += tl.dot(x, y)
        tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def tma_matmul_kernel(a_desc, b_desc, c_desc, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      WS: tl.constexpr):
    """Tiles moved by the tensor-memory accelerator (host-built TensorDescriptors); WS asks the
    compiler to warp-specialize the K loop (producer warps issue TMA, consumer warps issue MMA)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=WS):
        x = a_desc.load([pm * BM, k])
        y = b_desc.load([k, pn * BN])
        acc = tl.dot(x, y, acc)
    c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))


@triton.jit
def mx_matmul_kernel(a, a_scale, b, b_scale, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, SCALED: tl.constexpr):
    """MXFP8 (OCP microscaling: e4m3 values, one e8m0 power-of-two scale per 32 along K).

    SCALED=True uses tl.dot_scaled (hardware block-scaled MMA where the target has it);
    SCALED=False is the twin that dequantizes in registers and runs a bf16 MMA."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + rn[:, None] * K + (k + rk)[None, :])  # B stored [N, K]
        xs = tl.load(a_scale + rm[:, None] * (K // 32) + (k // 32 + rs)[None, :])
        ys = tl.load(b_scale + rn[:, None] * (K // 32) + (k // 32 + rs)[None, :])
        if SCALED:
            acc = tl.dot_scaled(x, xs, "e4m3", y.T, ys, "e4m3", acc)
        else:
            xsf = tl.exp2(xs.to(tl.float32) - 127.0)
            ysf = tl.exp2(ys.to(tl.float32) - 127.0)
            xd = tl.reshape(tl.reshape(x.to(tl.float32), (BM, BK // 32, 32)) * xsf[:, :, None], (BM, BK))
            yd = tl.reshape(tl.reshape(y.to(tl.float32), (BN, BK // 32, 32)) * ysf[:, :, None], (BN, BK))
            acc = tl.dot(xd.to(tl.bfloat16), yd.to(tl.bfloat16).T, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def add_kernel(x, y, out, n, BLOCK: tl.constexpr):
    """Elementwise add: with 16-byte-aligned pointers each thread moves 128 bits per access."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out + offs, tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)


@triton.jit
def row_sum_kernel(x, out, N, BLOCK: tl.constexpr):
    """Row sums with tl.sum over a block: lanes combine partials with warp shuffles / DPP."""
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    v = tl.load(x + r * N + offs, mask=offs < N, other=0.0)
    tl.store(out + r, tl.sum(v, 0))


@triton.jit
def row_sum_serial_kernel(x, out, N, BLOCK: tl.constexpr):
    """The twin: one scalar running sum, element by element (right, but no cross-lane reduction)."""
    r = tl.program_id(0)
    acc = tl.load(x + r * N)
    for i in range(1, N):
        acc += tl.load(x + r * N + i)
    tl.store(out + r, acc)


# ------------------------------------------------------------------------------------ runners

# small enough for the interpreter, large enough for every target's MMA instruction shapes
MM = {"M": 128, "N": 128, "K": 128, "BM": 128, "BN": 64, "BK": 32}


def _dev() -> str:
    """Device of the kernel's tensors: CPU under the interpreter, the GPU for a native launch.

    Inputs are always drawn on the CPU (seeded, so both modes see the same values) and references
    computed there (integer matmul has no CUDA kernel); only the kernel's arguments move.
    """
    return launch_device()


def _operands(dtype, M, N, K, seed=0, b_nk=False):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        a = torch.randint(-8, 8, (M, K), generator=g, dtype=torch.int8)
        b = torch.randint(-8, 8, (N, K) if b_nk else (K, N), generator=g, dtype=torch.int8)
        return a, b
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn((N, K) if b_nk else (K, N), generator=g).to(dtype)
    return a, b


def run_matmul(kernel=matmul_kernel, dtype=torch.bfloat16, num_stages=1, num_warps=4, offset=0, **shape):
    """Launch a tl.dot-style matmul kernel; ``offset`` shifts the operands by elements (misaligns)."""
    s = {**MM, **shape}
    M, N, K = s["M"], s["N"], s["K"]
    a, b = _operands(dtype, M, N, K)
    is_int = dtype == torch.int8
    ref = a.int() @ b.int() if is_int else a.float() @ b.float()
    dev = _dev()
    a, b = a.to(dev), b.to(dev)
    if offset:
        a = torch.cat([a.new_zeros(offset), a.flatten()])[offset:].view(M, K)
    c = torch.empty(M, N, dtype=torch.int32 if is_int else torch.float32, device=dev)
    kw = {"ACC": tl.int32} if is_int else {}
    kernel[(M // s["BM"], N // s["BN"])](a, b, c, M, N, K, BM=s["BM"], BN=s["BN"], BK=s["BK"],
                                         num_stages=num_stages, num_warps=num_warps, **kw)
    return c, ref


def run_upcast_matmul(dtype=torch.float8_e4m3fn, num_stages=1):
    s = MM
    M, N, K = s["M"], s["N"], s["K"]
    a, b = _operands(dtype, M, N, K)
    ref = a.float() @ b.float()
    dev = _dev()
    a, b = a.to(dev), b.to(dev)
    c = torch.empty(M, N, device=dev)
    matmul_upcast_kernel[(M // s["BM"], N // s["BN"])](a, b, c, M, N, K, BM=s["BM"], BN=s["BN"], BK=s["BK"],
                                                       num_stages=num_stages)
    return c, ref


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def run_bias_gelu(fuse=True):
    s = MM
    M, N, K = s["M"], s["N"], s["K"]
    a, b = _operands(torch.bfloat16, M, N, K)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1))
    ref = gelu_tanh(a.float() @ b.float() + bias)
    dev = _dev()
    a, b, bias = a.to(dev), b.to(dev), bias.to(dev)
    c = torch.empty(M, N, device=dev)
    matmul_bias_gelu_kernel[(M // s["BM"], N // s["BN"])](a, b, bias, c, M, N, K, BM=s["BM"], BN=s["BN"],
                                                          BK=s["BK"], FUSE=fuse)
    return c, ref


def run_splitk(atomic=True, split=4):
    s = MM
    M, N, K = s["M"], s["N"], s["K"]
    a, b = _operands(torch.bfloat16, M, N, K)
    ref = a.float() @ b.float()
    dev = _dev()
    a, b = a.to(dev), b.to(dev)
    c = torch.zeros(M, N, device=dev)
    tiles = (M // s["BM"]) * (N // s["BN"])
    splitk_kernel[(tiles, split)](a, b, c, M, N, K, BM=s["BM"], BN=s["BN"], BK=s["BK"], SPLIT=split, ATOMIC=atomic)
    return c, ref


def run_persistent(persistent=True, programs=2):
    s = {**MM, "M": 256}  # 4 tiles on 2 programs: each program walks two
    M, N, K = s["M"], s["N"], s["K"]
    if not persistent:
        return run_matmul(matmul_kernel, **s)
    a, b = _operands(torch.bfloat16, M, N, K)
    ref = a.float() @ b.float()
    dev = _dev()
    a, b = a.to(dev), b.to(dev)
    c = torch.empty(M, N, device=dev)
    persistent_matmul_kernel[(programs,)](a, b, c, M, N, K, BM=s["BM"], BN=s["BN"], BK=s["BK"])
    return c, ref


def run_tma(ws=False, tma=True, num_stages=1, num_warps=4):
    s = MM
    M, N, K = s["M"], s["N"], s["K"]
    if not tma:
        return run_matmul(matmul_kernel, num_stages=num_stages, num_warps=num_warps)
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b = _operands(torch.bfloat16, M, N, K)
    ref = a.float() @ b.float()
    dev = _dev()
    a, b = a.to(dev), b.to(dev)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    da = TensorDescriptor.from_tensor(a, [s["BM"], s["BK"]])
    db = TensorDescriptor.from_tensor(b, [s["BK"], s["BN"]])
    dc = TensorDescriptor.from_tensor(c, [s["BM"], s["BN"]])
    tma_matmul_kernel[(M // s["BM"], N // s["BN"])](da, db, dc, K, BM=s["BM"], BN=s["BN"], BK=s["BK"], WS=ws,
                                                    num_stages=num_stages, num_warps=num_warps)
    return c.float(), ref


def mx_quantize(x: torch.Tensor):
    """MXFP8 e4m3 quantization along the last dim: (values e4m3, scales uint8 e8m0), blocks of 32."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    e = torch.floor(torch.log2(amax)) - 8  # e4m3 max 448 = 1.75 * 2^8
    q = (blocks / torch.exp2(e)).to(torch.float8_e4m3fn)
    return q.view(x.shape), (e.squeeze(-1) + 127).to(torch.uint8)


def mx_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    v = q.float().view(*q.shape[:-1], -1, 32) * torch.exp2(scale.float() - 127)[..., None]
    return v.view(q.shape)


def run_mx_matmul(scaled=True):
    s = {**MM, "BK": 64}
    M, N, K = s["M"], s["N"], s["K"]
    a, b = _operands(torch.float32, M, N, K, b_nk=True)
    qa, sa = mx_quantize(a)
    qb, sb = mx_quantize(b)
    ref = mx_dequantize(qa, sa) @ mx_dequantize(qb, sb).T
    dev = _dev()
    qa, sa, qb, sb = qa.to(dev), sa.to(dev), qb.to(dev), sb.to(dev)
    c = torch.empty(M, N, device=dev)
    mx_matmul_kernel[(M // s["BM"], N // s["BN"])](qa, sa, qb, sb, c, M, N, K, BM=s["BM"], BN=s["BN"], BK=s["BK"],
                                                   SCALED=scaled)
    return c, ref


def run_add(aligned=True, n=4096, block=1024):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, n + 1, generator=g)
    off = 0 if aligned else 1
    ref = base[0, off:off + n] + base[1, off:off + n]
    base = base.to(_dev())
    x, y, out = base[0, off:off + n], base[1, off:off + n], base[2, off:off + n]
    add_kernel[(triton.cdiv(n, block),)](x, y, out, n, BLOCK=block)
    return out, ref


def run_row_sum(serial=False, rows=4, n=256):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(0))
    ref = x.sum(1)
    x = x.to(_dev())
    out = torch.empty(rows, device=x.device)
    k = row_sum_serial_kernel if serial else row_sum_kernel
    k[(rows,)](x, out, n, BLOCK=n)
    return out, ref
