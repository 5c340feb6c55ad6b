"""hopper / wgmma: Warpgroup-level asynchronous MMA (wgmma.mma_async, 4 warps, operands from shared memory), Hopper's tensor-core path; mma.sync reaches only a fraction of peak on H100.

When it pays: Every GEMM-like loop in bf16/fp16 with a 64-row (multiple) tile and 4+ warps.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_fma_kernel)``: broadcast-multiply-and-sum on CUDA cores; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "hopper", "wgmma"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel)


def broken():
    return ex.run_matmul(ex.matmul_fma_kernel)


def test_wgmma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_wgmma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
