"""mi350 / mfma: CDNA matrix cores through v_mfma instructions (bf16 inputs, fp32 accumulate).

When it pays: Every GEMM-like loop.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_fma_kernel)``: fp32 multiply-and-sum (the compiler can only use fp32 MFMA, 8x slower); it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "mi350", "mfma"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel)


def broken():
    return ex.run_matmul(ex.matmul_fma_kernel)


def test_mfma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_mfma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
