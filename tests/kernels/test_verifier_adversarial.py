"""The kernel verifier against candidates that try to fool it or escape it.

The slow suite runs every candidate in ``tests/kernels/exploits/`` through ``verify`` (each in its
own sandboxed process) and judges from outside too (a host folder none may write into, a host
loopback port none may reach); each exploit is paid with the right answer only if its trick
works, so "rejected" also says it did not. The fast tests cover the pieces that need no sandboxed
run: the comparison, the static check, the refusal without a sandbox, and the ranking in ``generate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmkit.kernels.workbench import generate as gen
from llmkit.kernels.workbench.report import FIXTURES, run_exploits
from llmkit.kernels.workbench.verify import compare, static_check, verify
from llmkit.tools import sandbox

EXPLOITS = Path(__file__).resolve().parent / "exploits"
needs_sandbox = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
# the tests of this file and test_workbench.py that use the verifier runs of tests/kernels/conftest.py share
# one xdist worker, and with it those runs; the rest of each file runs where xdist puts it
same_worker = pytest.mark.xdist_group("kernel_verifier")

# what each exploit must be rejected for (a substring of its reasons)
EXPECTED = {
    "forged_verdict": "wrong result",
    "recorder_off": "in_launch flag",
    "popped_mode": "popped a dispatch mode",
    "disabled_dispatch": "disabled torch dispatch",
    "fished_reference": "wrong result",
    "mutated_input": "modified its inputs",
    "aliased_output": "alias an input",
    "nan_output": "non-finite output",
    "constant_output": "constant",
    "numpy_escape": "out of torch",
    "host_write": "wrong result",
    "loopback": "wrong result",
    "host_secrets": "wrong result",
}


@pytest.fixture(scope="module")
def outcomes(verify_runs):
    """Every exploit's verdict and a good kernel's beside them (still accepted), all through the shared pool
    of verifier runs (tests/kernels/conftest.py): each still in its own sandboxed process."""
    ref, good = FIXTURES / "ref_softmax.py", FIXTURES / "good_softmax.py"
    sandboxed = verify_runs.submit(ref, good, "hopper", "bf16", trials=1, timeout=300, timing=False)
    unsafe = verify_runs.submit(ref, good, "hopper", "bf16", trials=1, timeout=300, timing=False, unsafe=True)
    res = run_exploits(EXPLOITS, "hopper", parallel=3,
                       verify_fn=lambda r, c: verify_runs(r, c, "hopper", "bf16", trials=1, timeout=300, timing=False))
    return res, sandboxed.result(), unsafe.result()


def test_every_exploit_has_an_expectation():
    assert {p.stem for p in EXPLOITS.glob("*.py") if not p.name.startswith("_")} == set(EXPECTED)


@needs_sandbox
@pytest.mark.slow
@same_worker
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_exploit_is_rejected_and_contained(outcomes, name):
    o = outcomes[0][name]
    assert o["rejected"], f"{name} was accepted"
    assert o["contained"], f"{name} escaped: {o['escaped']}"
    assert any(EXPECTED[name] in r for r in o["reasons"]), o["reasons"]


@needs_sandbox
@pytest.mark.slow
@same_worker
def test_good_kernel_is_still_accepted_beside_the_exploits(outcomes):
    r = outcomes[1]
    assert r["correct"] and r["reasons"] == [] and r["sandboxed"] and r["flags"] == []
    assert set(r["checks"]) == {"outside", "best_effort"} and "no_torch_fallback" in r["checks"]["best_effort"]
    assert len(set(r["shapes"])) == 3  # the example and two shapes drawn at random
    unsafe = outcomes[2]  # --unsafe-no-sandbox: the same verdict, marked as not isolated
    assert unsafe["correct"] and unsafe["sandboxed"] is False and unsafe["flags"] == ["unsandboxed"]


# ------------------------------------------------------------------------------ no sandboxed run needed


def test_comparison_rejects_nan_constant_zero_and_wrong_outputs():
    torch.manual_seed(0)
    ref = torch.softmax(torch.randn(6, 96), -1)
    assert compare([ref.clone()], [ref], 1.6e-2)[0] == []
    cases = {"non-finite": torch.full_like(ref, float("nan")), "constant": torch.full_like(ref, 1 / 96),
             "all zeros": torch.zeros_like(ref), "wrong result": ref.flip(-1), "output shapes": ref[:3]}
    for want, out in cases.items():
        problems = compare([out], [ref], 1.6e-2)[0]
        assert any(want in p for p in problems), (want, problems)
    half_nan = ref.clone()
    half_nan[0, 0] = float("nan")  # one NaN is enough
    assert compare([half_nan], [ref], 1.6e-2)[0]
    masked = ref.clone()
    masked[:, 0] = float("-inf")  # a reference's own infinities must be matched, not ignored
    assert compare([masked.clone()], [masked], 1.6e-2)[0] == []
    assert compare([torch.where(masked.isinf(), 0.0, masked)], [masked], 1.6e-2)[0]


def test_static_check_flags_torch_names_built_at_run_time():
    src = (FIXTURES / "good_softmax.py").read_text()
    built = src.replace("return out", 'return getattr(torch, "soft" + "max")(out, -1)')
    assert any("name built at run time" in p for p in static_check(built)[0])
    assert any("vars()" in p for p in static_check(src.replace("return out", 'return vars(torch)["exp"](out)'))[0])
    assert static_check(src.replace("return out", 'return out.to(getattr(torch, "float32"))'))[0] == []


def test_verify_and_the_cli_refuse_without_a_sandbox(monkeypatch, tmp_path):
    from argparse import Namespace

    from llmkit.cli import UserError
    from llmkit.commands.kernels import run_generate, run_verify

    monkeypatch.setattr(sandbox, "check_available", lambda: (False, "bwrap not found"))
    ref, cand = FIXTURES / "ref_softmax.py", FIXTURES / "good_softmax.py"
    with pytest.raises(sandbox.SandboxUnavailable, match="--unsafe-no-sandbox"):
        verify(ref, cand)
    args = Namespace(ref=str(ref), candidate=str(cand), arch="hopper", precision="bf16", trials=1, timeout=30.0,
                     unsafe_no_sandbox=False)
    with pytest.raises(UserError, match="bwrap not found.*--unsafe-no-sandbox"):
        run_verify(args)
    gargs = Namespace(ref=str(ref), arch="hopper", endpoint="http://127.0.0.1:9/v1", model="m", budget=1,
                      candidates=1, parallel=1, precision="bf16", max_tokens=16, temperature=0.0, max_examples=0,
                      trials=1, timeout=30.0, request_timeout=1.0, out=str(tmp_path), unsafe_no_sandbox=False)
    with pytest.raises(UserError, match="--unsafe-no-sandbox"):
        run_generate(gargs)
    with pytest.raises(sandbox.SandboxUnavailable):
        gen.generate(ref, "hopper", "http://127.0.0.1:9/v1", "m", tmp_path, budget=1, progress=False)


def _cand(correct=True, speedup=None, flags=(), sandboxed=True, i=0):
    return gen.Candidate(0, i, "code", "reply", {"correct": correct, "speedup": speedup, "flags": list(flags),
                                                 "sandboxed": sandboxed, "strategies": [], "max_abs_err": 0.0})


def test_generate_never_ranks_a_flagged_or_unverified_candidate_above_a_clean_one():
    clean = _cand(speedup=1.1)
    flagged = _cand(speedup=80.0, flags=["suspicious_speedup"])
    unsandboxed = _cand(speedup=5.0, flags=["unsandboxed"], sandboxed=False)
    wrong = _cand(correct=False, speedup=9.0)
    unverified = gen.Candidate(0, 4, "code", "reply", None, "verification failed")
    order = sorted([flagged, wrong, unverified, unsandboxed, clean], key=lambda c: c.score, reverse=True)
    assert order[:3] == [clean, unsandboxed, flagged]
    assert [c.tier for c in order] == [3, 2, 1, 0, 0]


def test_generate_does_not_make_a_flagged_candidate_best(monkeypatch, tmp_path):
    """The loop as bench/tests drive it, with verify stubbed: round 0 is a 'correct' kernel with a
    suspicious speedup, round 1 a clean, slower one; best.py must be the clean one."""
    verdicts = iter([{"correct": True, "speedup": 40.0, "flags": ["suspicious_speedup"], "sandboxed": True,
                      "reasons": ["suspicious speedup 40.0x > 10x: flagged, not trusted"], "strategies": ["a", "b"],
                      "max_abs_err": 0.0},
                     {"correct": True, "speedup": 1.2, "flags": [], "sandboxed": True, "reasons": [],
                      "strategies": [], "max_abs_err": 1e-3}])
    monkeypatch.setattr(gen, "verify", lambda *a, **k: next(verdicts))
    monkeypatch.setattr(sandbox, "check_available", lambda: (True, "stubbed: verify is stubbed too"))
    replies = ["```python\nclass ModelNew: 'fast'\n```", "```python\nclass ModelNew: 'clean'\n```"]
    with gen.scripted_endpoint(replies) as url:
        s = gen.generate(FIXTURES / "ref_softmax.py", "hopper", url, "scripted", tmp_path, budget=2, candidates=1,
                         parallel=1, progress=False, max_examples=0)
    assert s["n_flagged"] == 1 and s["best"]["round"] == 1
    assert "clean" in (tmp_path / "best.py").read_text()
    rows = [json.loads(x) for x in (tmp_path / "trajectory.jsonl").read_text().splitlines()]
    assert any("flagged" in f for f in rows[0]["feedback"])
