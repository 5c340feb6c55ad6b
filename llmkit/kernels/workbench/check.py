"""One strategy test's two questions: is the kernel right, and does its compiled code use the strategy?

``check_strategy(arch, strategy, run)`` calls ``run()`` (which launches kernels and returns
``(out, expected)``) inside :func:`~.compiled.capture`, so the kernels run under the interpreter
on CPU (natively on a GPU), then compiles every recorded launch for ``arch`` and asks the
taxonomy whether the strategy is there. Strategy tests assert both for the expert kernel and
assert that the deliberately broken twin fails one of them. ``precisions`` says which precisions
the launches actually computed in; each strategy test asserts it equals the test's ``PRECISIONS``,
so a test cannot claim a precision it does not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compiled import capture, compile_launch, native_arch
from .taxonomy import load_taxonomy


@dataclass
class StrategyCheck:
    arch: str
    strategy: str
    correct: bool
    max_abs_err: float
    present: bool
    evidence: list = field(default_factory=list)
    found: list = field(default_factory=list)  # every strategy of the arch found in the compiled code
    compile_error: str | None = None
    ran_natively: bool = False
    precisions: list = field(default_factory=list)  # operand precisions of the launches (launch_precision)

    @property
    def ok(self) -> bool:
        return self.correct and self.present


# torch dtype -> the precision names of the taxonomy and of the tests' PRECISIONS
_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8",
              torch.float8_e5m2: "fp8", torch.int8: "int8"}
_WIDTH = {"fp8": 8, "int8": 8, "bf16": 16, "fp16": 16, "fp32": 32}


def launch_precision(launch) -> str | None:
    """The precision a recorded launch computes in: the narrowest of its tensor arguments
    (TensorDescriptors by their base); FP8 values next to uint8 (e8m0) scales are ``mxfp8``.
    Wider outputs/accumulators (fp32, int32) and bias vectors do not lower it; None without tensors."""
    tensors = [getattr(a, "base", a) for a in launch.args]
    dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor)}
    names = {_PRECISION[d] for d in dtypes if d in _PRECISION}
    if "fp8" in names and torch.uint8 in dtypes:
        return "mxfp8"
    return min(names, key=lambda n: (_WIDTH[n], n)) if names else None


def close(out: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    out, expected = out.float().cpu(), expected.float().cpu()
    if out.shape != expected.shape or not torch.isfinite(out).all():
        return False, float("inf")
    err = (out - expected).abs()
    return bool((err <= atol + rtol * expected.abs()).all()), float(err.max()) if err.numel() else 0.0


def check_strategy(arch: str, strategy: str, run, rtol: float = 2e-2, atol: float = 2e-2) -> StrategyCheck:
    tax = load_taxonomy(arch)
    strat = tax[strategy]
    native = native_arch() == arch
    with capture(interpret=not native) as launches:
        out, expected = run()
    ok, err = close(out, expected, rtol, atol)
    res = StrategyCheck(arch, strategy, ok, err, False, ran_natively=native)
    res.precisions = sorted({p for p in map(launch_precision, launches) if p})
    for launch in launches:
        try:
            asm = compile_launch(launch, arch)
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile lacks every strategy
            res.compile_error = f"{launch.name}: {type(e).__name__}: {str(e)[-300:]}"
            continue
        ev = strat.evidence(asm)
        if ev is not None:
            res.present, res.evidence = True, ev
        res.found = sorted(set(res.found) | set(tax.found(asm)))
    return res
