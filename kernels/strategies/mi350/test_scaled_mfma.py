"""mi350 / scaled_mfma: CDNA4 block-scaled MFMA (v_mfma_scale_f32_*_f8f6f4): e8m0 scales per 32 K-elements applied in the matrix core for MXFP8/MXFP6/MXFP4.

When it pays: MX-quantized GEMMs.
Expert kernel: ``ex.run_mx_matmul(scaled=True)`` (source in llmkit/kernels/workbench/examples.py).
Broken twin: ``ex.run_mx_matmul(scaled=False)``: scales applied in registers, then a bf16 MFMA; it must fail the presence check.
Precisions run: MXFP8 (e4m3 values, e8m0 scales) only; the strategy also serves MXFP6 and MXFP4, which no
test here runs yet (see kernels/README.md).
"""

from llmkit.kernels.workbench import examples as ex
from llmkit.kernels.workbench.check import check_strategy

ARCH, STRATEGY = "mi350", "scaled_mfma"
PRECISIONS = ('mxfp8',)  # what good() runs; check_strategy's r.precisions must equal it


def good():
    return ex.run_mx_matmul(scaled=True)


def broken():
    return ex.run_mx_matmul(scaled=False)


def test_scaled_mfma_correct_and_present():
    r = check_strategy(ARCH, STRATEGY, good)
    assert r.correct, f"max abs err {r.max_abs_err}"
    assert r.present, f"{STRATEGY} not in the {ARCH} code; found {r.found}; {r.compile_error}"
    assert set(r.precisions) == set(PRECISIONS), f"ran {r.precisions}, claims {PRECISIONS}"


def test_scaled_mfma_broken_twin_fails():  # a test of the test
    r = check_strategy(ARCH, STRATEGY, broken)
    assert not r.present, f"{STRATEGY} wrongly recognized in the broken twin: {r.evidence}"
