"""ampere / split_k: Parallelism along K when M x N has too few tiles to fill the machine: K-slices run in parallel programs and meet through fp32 atomic adds (red/atom) in global memory.

When it pays: Skinny GEMMs (decode-time M small, large K) where M*N/(BM*BN) is below the number of SMs/CUs.
Expert kernel: ``ex.run_splitk(atomic=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_splitk(atomic=False)``: plain stores instead of atomics: the K-slices overwrite each other; it must fail the correctness check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "split_k"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_splitk(atomic=True)


def broken():
    return ex.run_splitk(atomic=False)


def test_split_k_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_split_k_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.correct, "the broken twin passed the correctness check"
