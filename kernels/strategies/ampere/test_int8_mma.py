"""ampere / int8_mma: Integer tensor cores: mma.sync m16n8k32 s8 x s8 -> s32 (2x the bf16 rate).

When it pays: Quantized (W8A8) GEMMs with int32 accumulation.
Expert kernel: ``ex.run_matmul(ex.matmul_kernel, dtype=torch.int8, num_stages=3)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_matmul(ex.matmul_fma_kernel, dtype=torch.int8)``: int8 widened to int32 and multiplied on CUDA cores; it must fail the presence check.
"""

import torch

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "ampere", "int8_mma"
PRECISIONS = ('int8',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_matmul(ex.matmul_kernel, dtype=torch.int8, num_stages=3)


def broken():
    return ex.run_matmul(ex.matmul_fma_kernel, dtype=torch.int8)


def test_int8_mma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_int8_mma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
