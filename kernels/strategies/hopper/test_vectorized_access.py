"""hopper / vectorized_access: 128-bit global loads/stores (ld.global.v4) when pointers and strides are known 16-byte aligned.

When it pays: Memory-bound elementwise and reduction kernels: 4x fewer memory instructions.
Expert kernel: ``ex.run_add(aligned=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_add(aligned=False)``: the same kernel on views offset by one element (alignment unknown: scalar loads); it must fail the presence check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "hopper", "vectorized_access"
PRECISIONS = ('fp32',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_add(aligned=True)


def broken():
    return ex.run_add(aligned=False)


def test_vectorized_access_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_vectorized_access_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
