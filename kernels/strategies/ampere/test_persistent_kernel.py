"""ampere / persistent_kernel: A grid of one program per SM/CU that loops over output tiles (tl.num_programs stride): no launch/tail overhead per tile, the epilogue of one tile overlaps the loads of the next, and tile order can be chosen for L2 reuse.

When it pays: Many small tiles, or GEMMs whose tile count is not a multiple of the SM count (wave quantization).
Expert kernel: ``ex.run_persistent(persistent=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_persistent(persistent=False)``: one program per tile (correct, not persistent); it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "persistent_kernel"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_persistent(persistent=True)


def broken():
    return ex.run_persistent(persistent=False)


def test_persistent_kernel_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_persistent_kernel_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
