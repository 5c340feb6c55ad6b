"""blackwell / fp8_tcgen05: FP8/FP6/FP4 operands on tcgen05 (kind::f8f6f4).

When it pays: FP8 GEMMs: 2x bf16 throughput.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel, dtype=torch.float8_e4m3fn, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_upcast_matmul()``: fp8 widened to bf16 before tl.dot; it must fail the presence check.
"""

import torch

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "blackwell", "fp8_tcgen05"
PRECISIONS = ('fp8',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel, dtype=torch.float8_e4m3fn, num_stages=3)


def broken():
    return ex.run_upcast_matmul()


def test_fp8_tcgen05_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_fp8_tcgen05_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
