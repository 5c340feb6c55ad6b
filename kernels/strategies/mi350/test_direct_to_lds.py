"""mi350 / direct_to_lds: Global loads that write straight into LDS (buffer_load ... lds), skipping VGPRs: AMD's counterpart of cp.async, used by the pipeliner.

When it pays: Shared-memory staged GEMM operands with num_stages >= 2.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_kernel)``: num_stages=1: loads through registers; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "mi350", "direct_to_lds"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel, num_stages=3)


def broken():
    return ex.run_matmul(ex.matmul_kernel)


def test_direct_to_lds_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_direct_to_lds_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
