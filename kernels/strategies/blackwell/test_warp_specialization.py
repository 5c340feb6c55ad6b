"""blackwell / warp_specialization: Producer warps issue TMA, a single MMA warp issues tcgen05, epilogue warps drain TMEM; registers rebalanced with setmaxnreg.

When it pays: Deep pipelines where issue slots, not bandwidth, limit the loop.
Expert kernel: ``ex.run_tma(ws=True, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_tma(ws=False, num_stages=3)``: the same TMA loop without warp_specialize; it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "blackwell", "warp_specialization"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_tma(ws=True, num_stages=3)


def broken():
    return ex.run_tma(ws=False, num_stages=3)


def test_warp_specialization_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_warp_specialization_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
