"""hopper / tma: The Tensor Memory Accelerator: one thread issues a bulk tensor copy (cp.async.bulk.tensor) described by a TMA descriptor; completion tracked by mbarrier transaction counts; address generation leaves the SM's ALUs.

When it pays: Tiled operand loads and output stores of GEMM/attention; frees registers and threads for compute.
Expert kernel: ``ex.run_tma(tma=True, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_tma(tma=False, num_stages=3)``: pointer loads (cp.async per thread); it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "hopper", "tma"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_tma(tma=True, num_stages=3)


def broken():
    return ex.run_tma(tma=False, num_stages=3)


def test_tma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_tma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
