"""mi350 / epilogue_fusion: The accumulator is finished in registers (bias, activation, scaling, cast) before the single store, instead of a second kernel re-reading C from global memory.

When it pays: Always when an elementwise op follows a GEMM; saves a full read+write of the output.
Expert kernel: ``ex.run_bias_gelu(fuse=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_bias_gelu(fuse=False)``: the epilogue left out (raw product stored); it must fail the correctness check.
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "mi350", "epilogue_fusion"
PRECISIONS = ('bf16',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_bias_gelu(fuse=True)


def broken():
    return ex.run_bias_gelu(fuse=False)


def test_epilogue_fusion_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_epilogue_fusion_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.correct, "the broken twin passed the correctness check"
