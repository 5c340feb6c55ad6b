"""blackwell / software_pipelining: Multi-buffered shared memory (num_stages >= 2): loads for iteration k+s are in flight while the tensor cores work on iteration k.

When it pays: Memory latency is exposed in the K loop (every GEMM-like loop with enough shared memory for the stages).
Expert kernel: ``ex.run_tma(tma=True, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_tma(tma=True, num_stages=1)``: num_stages=1: a single TMA buffer; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "blackwell", "software_pipelining"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_tma(tma=True, num_stages=3)


def broken():
    return ex.run_tma(tma=True, num_stages=1)


def test_software_pipelining_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_software_pipelining_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
