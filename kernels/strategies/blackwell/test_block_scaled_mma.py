"""blackwell / block_scaled_mma: Hardware microscaling: tcgen05.mma ... block_scale applies one e8m0 (MX) or e4m3 (NVFP4) scale per 32/16 K-elements inside the MMA, so MXFP8/MXFP4/NVFP4 GEMMs need no dequantization pass.

When it pays: MX/NVFP4-quantized weights and activations (low-precision inference and training).
Expert kernel: ``ex.run_mx_matmul(scaled=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_mx_matmul(scaled=False)``: scales applied in registers, then a bf16 MMA; it must fail the presence check.
Precisions run: MXFP8 (e4m3 values, e8m0 scales) only; the strategy also serves MXFP4 and NVFP4, which no
test here runs yet (see kernels/README.md).
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "blackwell", "block_scaled_mma"
PRECISIONS = ('mxfp8',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_mx_matmul(scaled=True)


def broken():
    return ex.run_mx_matmul(scaled=False)


def test_block_scaled_mma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_block_scaled_mma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
