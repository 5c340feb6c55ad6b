"""GPU timing for the verifier (only on a GPU; on CPU every figure is None).

``time_gpu(fn)``: warm-up calls, then ``repeats`` timed calls, each bracketed by CUDA events
and preceded by a write of a buffer larger than L2 (so no call is timed with the previous call's
data still cached), median in milliseconds. ``speedups`` compares a candidate's time (measured
in its own sandboxed process) with eager PyTorch and ``torch.compile`` of the reference, timed in
the verifier's; a speedup above ``SUSPICIOUS`` (10x) is flagged, not trusted: it usually means
the candidate skipped work (caching, a wrong shape) rather than found it.
"""

from __future__ import annotations

import statistics

import torch

SUSPICIOUS = 10.0
L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any L2 so far (H200: 60 MB, B200: 126 MB, MI355X: 256 MB MALL)


def time_gpu(fn, warmup: int = 5, repeats: int = 20) -> float | None:
    """Median milliseconds per call of ``fn()`` on the current CUDA/ROCm device; None without one."""
    if not torch.cuda.is_available():
        return None
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()  # evict L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def speedups(candidate_ms: float | None, reference, inputs, compile_reference: bool = True) -> dict:
    """{ms_candidate, ms_eager, ms_compile, speedup, speedup_vs_compile, suspicious}; None values on CPU.

    ``candidate_ms`` is measured with :func:`time_gpu` in the candidate's own (sandboxed) process; the
    reference and its ``torch.compile`` are timed here, on the same device."""
    out = {"ms_candidate": candidate_ms, "ms_eager": None, "ms_compile": None, "speedup": None,
           "speedup_vs_compile": None, "suspicious": False}
    if not torch.cuda.is_available():
        return out
    with torch.no_grad():
        out["ms_eager"] = time_gpu(lambda: reference(*inputs))
        if compile_reference:
            try:
                compiled = torch.compile(reference)
                out["ms_compile"] = time_gpu(lambda: compiled(*inputs))
            except Exception:  # noqa: BLE001 - torch.compile not available for this model: report None
                out["ms_compile"] = None
    if out["ms_candidate"]:
        out["speedup"] = out["ms_eager"] / out["ms_candidate"]
        if out["ms_compile"]:
            out["speedup_vs_compile"] = out["ms_compile"] / out["ms_candidate"]
        out["suspicious"] = out["speedup"] > SUSPICIOUS
    return out
