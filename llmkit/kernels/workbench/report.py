"""What ``bench/kernels.py`` measures, as library functions (tested through the bench and the tests).

- :func:`run_strategy_suite`: runs ``kernels/strategies`` with pytest (a subprocess, JUnit XML) and
  counts, per architecture, the strategies whose tests all pass (correct under the interpreter,
  present in the compiled code, broken twin caught).
- :data:`BAD_CANDIDATES` / :data:`GOOD_CANDIDATES` / :data:`PROJECT_KERNELS`: the verifier's
  fixture sets (``fixtures/``), and :func:`verify_set` to run one in parallel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[3]

# (name, reference, candidate, precision)
BAD_CANDIDATES = [
    ("wrong on a non-example shape", "ref_softmax", "bad_example_shape", "bf16"),
    ("zero output", "ref_softmax", "bad_zero", "bf16"),
    ("cached output", "ref_softmax", "bad_cached", "bf16"),
    ("torch fallback", "ref_softmax", "bad_torch_fallback", "bf16"),
    ("infinite loop", "ref_softmax", "bad_infinite_loop", "bf16"),
]
GOOD_CANDIDATES = [
    ("row softmax", "ref_softmax", "good_softmax", "bf16"),
    ("linear + bias + GELU", "ref_linear_gelu", "good_linear_gelu", "bf16"),
]
PROJECT_KERNELS = [
    ("InQuant quantize+pack", "ref_inquant_quant", "cand_inquant_quant", "fp32"),
    ("InQuant unpack+dequantize", "ref_inquant_dequant", "cand_inquant_dequant", "fp32"),
    ("ZO low-rank Rademacher perturbation", "ref_zo_perturb", "cand_zo_perturb", "fp32"),
]


def verify_set(items, arch: str = "hopper", *, trials: int = 1, timeout: float = 300.0, parallel: int = 3,
               strategies_for=()) -> dict:
    """{name: verify result} for (name, ref, candidate, precision) items, ``parallel`` subprocesses at a time."""
    from .verify import verify

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futs = {name: pool.submit(verify, FIXTURES / f"{ref}.py", FIXTURES / f"{cand}.py", arch, prec,
                                  trials=trials, timeout=timeout, strategies_for=tuple(strategies_for))
                for name, ref, cand, prec in items}
        return {k: f.result() for k, f in futs.items()}


def run_strategy_suite(timeout: float = 1800.0) -> dict:
    """Run every strategy test; returns {"per_arch": {arch: {"passed", "total", "failed": [...]}}, "passed", "total"}.

    A strategy counts as passed when all the tests in its file pass.
    """
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
        env.pop("TRITON_INTERPRET", None)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                        f"--junitxml={xml}", str(REPO / "kernels" / "strategies")], check=False, cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
        per_file: dict[str, bool] = {}
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                f = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
                ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
                per_file[f] = per_file.get(f, True) and ok
    from .compiled import ARCHS
    from .taxonomy import load_taxonomy

    per_arch = {}
    for arch in ARCHS:
        names = load_taxonomy(arch).names
        passed = [n for n in names if any(k.endswith((f"{arch}/test_{n}.py", f"{arch}.test_{n}", f"{arch}/test_{n}"))
                                          for k, v in per_file.items() if v)]
        per_arch[arch] = {"passed": len(passed), "total": len(names), "failed": sorted(set(names) - set(passed))}
    return {"per_arch": per_arch, "passed": sum(a["passed"] for a in per_arch.values()),
            "total": sum(a["total"] for a in per_arch.values())}
