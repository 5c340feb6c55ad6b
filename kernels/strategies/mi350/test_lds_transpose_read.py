"""mi350 / lds_transpose_read: gfx950's transposing LDS reads (ds_read_b64_tr_b16) that deliver MFMA operands in the layout the matrix core wants without a shuffle.

When it pays: MFMA operands whose K is not the contiguous dim in LDS (the B operand of row-major GEMMs).
Expert kernel: ``ex.run_matmul(ex.matmul_kernel)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_fma_kernel)``: fp32 operands (no 16-bit transposed reads); it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "mi350", "lds_transpose_read"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel)


def broken():
    return ex.run_matmul(ex.matmul_fma_kernel)


def test_lds_transpose_read_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_lds_transpose_read_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
