"""ampere / cp_async: Asynchronous global->shared copies (cp.async, sm_80+) that bypass registers and let the copy overlap compute.

When it pays: Tiles staged through shared memory (GEMM operands) with 16-byte aligned rows.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_kernel)``: num_stages=1: synchronous ld.global + st.shared; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "cp_async"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel, num_stages=3)


def broken():
    return ex.run_matmul(ex.matmul_kernel)


def test_cp_async_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_cp_async_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
