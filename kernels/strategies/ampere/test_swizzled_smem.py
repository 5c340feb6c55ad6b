"""ampere / swizzled_smem: XOR-swizzled shared-memory layouts (maxPhase > 1) read with ldmatrix, so the tensor-core operand loads are free of bank conflicts.

When it pays: Every shared-memory staged MMA operand; conflicts otherwise serialize up to 8-way.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_fma_kernel)``: no MMA operand layout (vec=1, maxPhase=1) and no ldmatrix; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "swizzled_smem"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel)


def broken():
    return ex.run_matmul(ex.matmul_fma_kernel)


def test_swizzled_smem_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_swizzled_smem_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
