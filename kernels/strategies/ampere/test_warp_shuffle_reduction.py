"""ampere / warp_shuffle_reduction: Reductions across the lanes of a warp with shfl.sync.bfly (registers only, no shared memory round trip).

When it pays: Row reductions: softmax, norms, sums.
Expert kernel: ``ex.run_row_sum(serial=False)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_row_sum(serial=True)``: a serial scalar loop; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "warp_shuffle_reduction"
PRECISIONS = ('fp32',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_row_sum(serial=False)


def broken():
    return ex.run_row_sum(serial=True)


def test_warp_shuffle_reduction_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_warp_shuffle_reduction_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
