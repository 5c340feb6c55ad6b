"""Hawkeye kernel workbench: taxonomy, compile-and-inspect, verifier (good and bad candidates), generation loop.

The strategy tests themselves live in kernels/strategies/<arch>/ (collected by plain ``pytest``).
Verifier runs start a sandboxed process each (torch + triton import, interpreter): the candidate
sets run in parallel and are marked slow. The adversarial candidates are in tests/kernels/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmkit.kernels.workbench.compiled import ARCHS, capture, compile_kernel, compile_launch
from llmkit.kernels.workbench.taxonomy import Strategy, load_taxonomy, parse_taxonomy, taxonomy_dir
from llmkit.kernels.workbench.verify import VerifyInputError, static_check, verify

FIX = Path(__file__).resolve().parents[2] / "llmkit" / "kernels" / "workbench" / "fixtures"
ROOT = Path(__file__).resolve().parents[2]
BAD = ["bad_example_shape", "bad_zero", "bad_cached", "bad_torch_fallback", "bad_infinite_loop"]
# the verifier tests here and in test_verifier_adversarial.py share one xdist worker, and with it the runs of
# tests/kernels/conftest.py; the rest of each file runs where xdist puts it
same_worker = pytest.mark.xdist_group("kernel_verifier")


# ------------------------------------------------------------------------------------ taxonomy


@pytest.mark.parametrize("arch", ARCHS)
def test_taxonomy_files_are_complete_and_point_at_real_tests(arch):
    tax = load_taxonomy(arch)
    assert tax.arch == arch and len(tax.strategies) >= 9
    for s in tax.strategies:
        assert s.exploits and s.pays_when and s.precisions and s.recognize
        assert s.test == f"kernels/strategies/{arch}/test_{s.name}.py"
        assert (ROOT / s.test).is_file(), s.test
    files = {p.stem[len("test_"):] for p in (ROOT / "kernels" / "strategies" / arch).glob("test_*.py")}
    assert files == set(tax.names)  # one test per strategy, no orphan tests


def test_taxonomies_list_only_what_each_architecture_has():
    names = {a: set(load_taxonomy(a).names) for a in ARCHS}
    assert "wgmma" in names["hopper"] and "wgmma" not in names["ampere"] | names["blackwell"] | names["mi350"]
    assert "tcgen05_mma" in names["blackwell"] and "block_scaled_mma" in names["blackwell"]
    assert not {"tma", "fp8_wgmma", "warp_specialization"} & names["ampere"]
    assert "mfma" in names["mi350"] and not {"tma", "wgmma", "mma_sync"} & names["mi350"]
    precisions = {p for s in load_taxonomy("ampere").strategies for p in s.precisions}
    assert not any("fp8" in p or "fp4" in p for p in precisions)  # no FP8 tensor cores on sm_80


def test_strategy_recognition_needs_every_pattern():
    s = Strategy("x", "e", "p", {"ptx": [r"wgmma\.mma_async", r"e4m3"]}, ("fp8",), "t")
    assert s.present({"ptx": "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"})
    assert not s.present({"ptx": "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"})
    assert not s.present({"amdgcn": "wgmma e4m3"})  # wrong stage
    with pytest.raises(ValueError, match="unknown stage"):
        parse_taxonomy({"arch": "a", "strategies": [{"name": "n", "exploits": "", "pays_when": "", "precisions": [],
                                                      "test": "", "recognize": {"sass": ["x"]}}]})
    with pytest.raises(ValueError, match="lacks"):
        parse_taxonomy({"arch": "a", "strategies": [{"name": "n"}]})
    assert taxonomy_dir().is_dir()


# ------------------------------------------------------------------------------------ compile and inspect


def test_capture_runs_on_cpu_and_the_same_launch_compiles_per_target():
    from llmkit.kernels.workbench import examples as ex

    with capture(interpret=True) as launches:
        out, ref = ex.run_matmul(ex.matmul_kernel)
    assert len(launches) == 1 and launches[0].name == "matmul_kernel"
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    want = {"ampere": ("ptx", "mma.sync"), "hopper": ("ptx", "wgmma"), "blackwell": ("ptx", "tcgen05.mma"),
            "mi350": ("amdgcn", "v_mfma")}
    for arch, (stage, needle) in want.items():
        asm = compile_launch(launches[0], arch)
        assert needle in asm[stage], arch
    assert compile_launch(launches[0], "hopper") is compile_launch(launches[0], "hopper")  # cached


def test_interpreter_bf16_dot_is_fixed_and_restored():
    """Triton 3.9's interpreter multiplies bf16 bits; the workbench widens operands during its runs only."""
    from triton.runtime.interpreter import InterpreterBuilder

    from llmkit.kernels.workbench import examples as ex

    before = InterpreterBuilder.create_dot
    with capture(interpret=True):
        out, ref = ex.run_matmul(ex.matmul_kernel, M=128, N=64, K=64)
    assert (out - ref).abs().max() < 1e-3
    assert InterpreterBuilder.create_dot is before


def test_compile_kernel_without_running():
    from llmkit.kernels.workbench import examples as ex

    x = torch.empty(4096)
    asm = compile_kernel(ex.add_kernel, "ampere", x, x, x, 4096, BLOCK=1024)
    assert "ld.global.v4" in asm["ptx"]


def test_zo_perturb_kernel_matches_reference():
    from llmkit.kernels import zo_perturb as zp

    w = torch.randn(70, 50)
    u, v = zp.rademacher((70, 3), 1), zp.rademacher((50, 3), 2)
    with capture(interpret=True) as launches:
        add = zp.perturb_triton(w, u, v, 0.01, "add")
        mul = zp.perturb_triton(w, u, v, 0.01, "mul")
        inplace = w.clone()
        zp.perturb_triton(inplace, u, v, 0.01, "add", out=inplace)
    torch.testing.assert_close(add, zp.perturb_ref(w, u, v, 0.01, "add"))
    torch.testing.assert_close(mul, zp.perturb_ref(w, u, v, 0.01, "mul"))
    torch.testing.assert_close(inplace, add)
    z = (add - w) / 0.01  # entries of U V^T / sqrt(r): mean 0, variance 1, values in {+-1/sqrt3, +-3/sqrt3}
    assert set(torch.round(z * 3 ** 0.5).unique().tolist()) <= {-3.0, -1.0, 1.0, 3.0}
    assert "wgmma" in compile_launch(launches[0], "hopper")["ptx"]
    with pytest.raises(ValueError, match="mode"):
        zp.perturb_ref(w, u, v, 0.1, "scale")


def test_launch_device_follows_the_capture_mode():
    from llmkit.kernels.workbench.compiled import launch_device

    with capture(interpret=True):
        assert launch_device() == "cpu"
        with capture(interpret=False):  # a native capture (on a GPU of the test's architecture)
            assert launch_device() == "cuda"
        assert launch_device() == "cpu"
    from triton import knobs

    native = torch.cuda.is_available() and not knobs.runtime.interpret
    assert launch_device() == ("cuda" if native else "cpu")  # outside a capture: where a plain launch runs


def test_example_runners_put_every_kernel_argument_on_the_launch_device(monkeypatch):
    """Natively (a GPU of the test's own arch) the kernels need device tensors: every runner must move
    every tensor argument (TensorDescriptors by their base) to ``launch_device()``. Checked on CPU
    with the ``meta`` device standing in for ``cuda`` and recording stand-ins for the kernels."""
    from llmkit.kernels.workbench import examples as ex
    from llmkit.kernels.workbench.compiled import _is_kernel_fn

    seen = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for a in args:
                    t = getattr(a, "base", a)
                    if isinstance(t, torch.Tensor):
                        seen.append((self.name, t.device.type))
            return launch

    for name in dir(ex):
        if _is_kernel_fn(getattr(ex, name)):
            monkeypatch.setattr(ex, name, Fake(name))
    monkeypatch.setattr(ex, "_dev", lambda: "meta")
    runs = [lambda: ex.run_matmul(ex.matmul_kernel), lambda: ex.run_matmul(ex.matmul_fma_kernel, dtype=torch.int8),
            lambda: ex.run_matmul(ex.matmul_kernel, dtype=torch.float8_e4m3fn), lambda: ex.run_matmul(ex.matmul_kernel, offset=1),
            ex.run_upcast_matmul, ex.run_bias_gelu, ex.run_splitk, ex.run_persistent,
            lambda: ex.run_persistent(persistent=False), ex.run_tma, lambda: ex.run_tma(tma=False), ex.run_mx_matmul,
            ex.run_add, lambda: ex.run_add(aligned=False), ex.run_row_sum, lambda: ex.run_row_sum(serial=True)]
    for run in runs:
        out, ref = run()
        assert out.device.type == "meta" and ref.device.type == "cpu"  # references stay on the CPU
    assert len({n for n, _ in seen}) >= 10 and {d for _, d in seen} == {"meta"}, seen


def test_launch_precision_names_what_the_kernel_computes_in():
    from llmkit.kernels.workbench.check import launch_precision
    from llmkit.kernels.workbench.compiled import Launch

    def prec(*args):
        return launch_precision(Launch(None, args, {}))

    bf, f32 = torch.empty(2, dtype=torch.bfloat16), torch.empty(2)
    assert prec(bf, bf, f32, f32, 128) == "bf16"  # fp32 bias/output do not count
    assert prec(torch.empty(2, dtype=torch.int8), torch.empty(2, dtype=torch.int32)) == "int8"
    assert prec(torch.empty(2, dtype=torch.float8_e4m3fn), f32) == "fp8"
    assert prec(torch.empty(2, dtype=torch.float8_e4m3fn), torch.empty(2, dtype=torch.uint8), f32) == "mxfp8"
    assert prec(f32, f32, 7) == "fp32" and prec(3) is None


def test_readme_counts_the_strategy_tests():
    import re

    n = len(list((ROOT / "kernels" / "strategies").glob("*/test_*.py")))
    assert n == sum(len(load_taxonomy(a).strategies) for a in ARCHS)
    m = re.search(r"\((\d+) in all", (ROOT / "kernels" / "README.md").read_text())
    assert m and int(m.group(1)) == n


def test_zo_perturb_kernel_matches_zo_direction_semantics():
    """The kernel is not wired into llmkit/optim/zo.py; it reproduces zo.py's low-rank Rademacher
    direction (U, V drawn as zo.direction draws them) in both of zo.py's perturbation modes."""
    import math

    from llmkit.kernels import zo_perturb as zp
    from llmkit.optim import zo

    m, n, r, seed, mu = 70, 50, 4, 1234, 0.01
    z = zo.direction((m, n), seed, distribution="rademacher", rank=r)
    u = zo.sample((m, r), zo._generator(seed, None), "rademacher")
    v = zo.sample((n, r), zo._generator(zo.mix_seed(seed, 0x56), None), "rademacher")
    torch.testing.assert_close(u @ v.T / math.sqrt(r), z)
    w = torch.randn(m, n)
    with capture(interpret=True):
        add = zp.perturb_triton(w, u, v, mu, "add")
        mul = zp.perturb_triton(w, u, v, mu, "mul")
    torch.testing.assert_close(add, w + mu * z)
    torch.testing.assert_close(mul, w * (1 + mu * z))


# ------------------------------------------------------------------------------------ verifier: static


def test_static_check_flags_torch_compute_and_reference_use():
    ok = (FIX / "good_softmax.py").read_text()
    problems, kernels = static_check(ok)
    assert problems == [] and kernels == ["softmax_kernel"]
    cheat = ok.replace("return out", "return torch.softmax(x * self.scale, -1)")
    assert any("torch.softmax" in p for p in static_check(cheat)[0])
    assert any("'@'" in p for p in static_check(ok.replace("return out", "return x @ x.T"))[0])
    assert any(".sum()" in p for p in static_check(ok.replace("return out", "return out.sum()"))[0])
    assert any("reference" in p for p in static_check("from ref_softmax import Model\n" + ok,
                                                       FIX / "ref_softmax.py")[0])
    assert static_check("def f(:")[0][0].startswith("candidate does not parse")
    assert "candidate has no @triton.jit kernel" in static_check("class ModelNew: pass\n")[0]


def test_bad_input_is_a_verify_input_error(tmp_path):
    with pytest.raises(VerifyInputError, match="not found"):
        verify(tmp_path / "nope.py", FIX / "good_softmax.py")
    with pytest.raises(VerifyInputError, match="must define Model"):
        verify(FIX / "good_softmax.py", FIX / "good_softmax.py")
    with pytest.raises(VerifyInputError, match="arch"):
        verify(FIX / "ref_softmax.py", FIX / "good_softmax.py", arch="volta")
    with pytest.raises(VerifyInputError, match="precision"):
        verify(FIX / "ref_softmax.py", FIX / "good_softmax.py", precision="fp7")


def test_candidate_without_modelnew_is_rejected_without_running(tmp_path):
    cand = tmp_path / "c.py"
    cand.write_text("import triton\n@triton.jit\ndef k(x):\n    pass\n")
    r = verify(FIX / "ref_softmax.py", cand)
    assert r["correct"] is False and r["compiled"] is False
    assert any("ModelNew" in x for x in r["reasons"])


# ------------------------------------------------------------------------------------ verifier: runs


GOOD = [("good_softmax", "ref_softmax", "bf16"), ("good_linear_gelu", "ref_linear_gelu", "bf16"),
        ("cand_zo_perturb", "ref_zo_perturb", "fp32")]


@pytest.fixture(scope="module")
def candidate_runs(verify_runs):
    """{name: Future of verify's result} for the bad and the good candidates, all submitted at once to the
    shared pool of verifier runs (tests/kernels/conftest.py), so the two tests below overlap. The infinite
    loop goes first: it holds its slot for its whole timeout, and the others pass through the other two."""
    todo = sorted([(b, "ref_softmax", "bf16") for b in BAD] + GOOD, key=lambda t: t[0] != "bad_infinite_loop")
    return {name: verify_runs.submit(FIX / f"{ref}.py", FIX / f"{name}.py", "hopper", prec, trials=1,
                                     timeout=30 if name == "bad_infinite_loop" else 300, timing=False)
            for name, ref, prec in todo}


def _results(candidate_runs, names):
    return {name: candidate_runs[name].result() for name in names}


def test_timing_reference_is_a_cast_copy_and_timing_failures_are_recorded():
    """The GPU timing path, exercised on CPU: the timed reference is a copy cast to the inputs' dtype
    (an fp32 nn.Linear fed bf16 inputs raises), and a failure while timing is an error string in
    the result with speedup null, not a crashed worker."""
    from llmkit.kernels.workbench.verify import _timed, _timing_reference

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU()).eval()
    x = torch.randn(3, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        model(x)  # what timing the fp32 reference on bf16 inputs did
    timed = _timing_reference(model, torch.bfloat16)
    assert timed is not model and timed[0].weight.dtype == torch.bfloat16
    assert model[0].weight.dtype == torch.float32  # the reference used for correctness is untouched
    assert timed(x).dtype == torch.bfloat16
    assert _timing_reference(model, None) is model

    def fake_speedups(candidate_ms, reference, inputs):
        reference(*inputs)  # raises unless the reference was cast
        return {"speedup": 2.0 / candidate_ms, "speedup_vs_compile": 1.5, "suspicious": False}

    ok = _timed(1.0, model, [torch.randn(3, 8)], torch.bfloat16, fake_speedups)
    assert ok["speedup"] == 2.0 and ok["speedup_vs_compile"] == 1.5 and "timing_error" not in ok

    def broken_speedups(candidate_ms, reference, inputs):
        raise RuntimeError("CUDA error: out of memory")

    bad = _timed(1.0, model, [torch.randn(3, 8)], torch.bfloat16, broken_speedups)
    assert bad["speedup"] is None and bad["speedup_vs_compile"] is None
    assert "RuntimeError" in bad["timing_error"] and "out of memory" in bad["timing_error"]
    json.dumps(bad)  # the worker writes it as JSON


@pytest.mark.slow
@same_worker
def test_verifier_rejects_every_bad_candidate_for_its_own_reason(candidate_runs):
    res = _results(candidate_runs, BAD)
    for name, r in res.items():
        assert r["correct"] is False, name
        assert set(r) >= {"compiled", "correct", "max_abs_err", "max_rel_err", "strategies", "speedup", "reasons"}
    reasons = {k: " ".join(v["reasons"]) for k, v in res.items()}
    assert "shape" in reasons["bad_example_shape"]  # right at the example shape only
    assert "all zeros" in reasons["bad_zero"]
    assert "cached" in reasons["bad_cached"]
    assert "torch fallback" in reasons["bad_torch_fallback"] and "_softmax" in reasons["bad_torch_fallback"]
    assert "timed out" in reasons["bad_infinite_loop"]


@pytest.mark.slow
@same_worker
def test_verifier_accepts_good_candidates_and_reports_strategies(candidate_runs):
    res = _results(candidate_runs, [name for name, _, _ in GOOD])
    for name, r in res.items():
        assert r["correct"] and r["compiled"] and r["reasons"] == [], (name, r["reasons"])
        assert r["shapes_checked"] >= 2  # the example and at least one other shape
        assert r["speedup"] is None or torch.cuda.is_available()
    assert "wgmma" in res["good_linear_gelu"]["strategies"]
    assert "epilogue_fusion" in res["good_linear_gelu"]["strategies"]
    assert "warp_shuffle_reduction" in res["good_softmax"]["strategies"]


@pytest.mark.slow  # two `llmkit` subprocesses (the CLI imports every command module)
def test_cli_verify_prints_one_json_object_and_exit_codes(tmp_path):
    cand = tmp_path / "cand.py"
    cand.write_text("import torch\n")  # no ModelNew, no kernel: rejected before anything runs
    cmd = [sys.executable, "-m", "llmkit.cli", "kernels", "verify", "--ref", str(FIX / "ref_softmax.py"),
           "--candidate", str(cand), "--arch", "ampere"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd="/tmp", timeout=300)
    assert p.returncode == 0, p.stderr[-500:]  # the verification ran; the candidate failed it
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["correct"] is False and r["compiled"] is False and r["speedup"] is None
    assert any("ModelNew" in x for x in r["reasons"])
    bad_cmd = [str(FIX / "good_softmax.py") if x == str(FIX / "ref_softmax.py") else x for x in cmd]
    bad = subprocess.run(bad_cmd, check=False, capture_output=True, text=True, cwd="/tmp", timeout=300)
    assert bad.returncode == 2 and "must define Model" in bad.stderr


# ------------------------------------------------------------------------------------ generation loop


def test_generate_records_endpoint_failures_and_keeps_going(tmp_path):
    from llmkit.kernels.workbench.generate import generate

    s = generate(FIX / "ref_softmax.py", "ampere", "http://127.0.0.1:9/v1", "nobody", tmp_path, budget=3,
                 candidates=2, parallel=2, request_timeout=5, progress=False)
    assert s["n_candidates"] == 3 and s["n_errors"] == 3 and s["best"] is None and s["rounds"] == 2
    lines = (tmp_path / "trajectory.jsonl").read_text().splitlines()
    assert len(lines) == 3 and all("request failed" in json.loads(x)["error"] for x in lines)
    assert not (tmp_path / "best.py").exists()


def test_prompt_carries_reference_taxonomy_examples_and_feedback():
    from llmkit.kernels.workbench.generate import build_prompt, extract_code

    ref = (FIX / "ref_linear_gelu.py").read_text()
    msgs = build_prompt(ref, "blackwell", feedback=["wrong result on shape X"], previous="class ModelNew: pass")
    user = msgs[1]["content"]
    assert "class Model(nn.Module)" in user and "tcgen05_mma" in user and "block_scaled_mma" in user
    assert "def test_" in user and "@triton.jit" in user  # worked examples: a strategy test and its kernel
    assert "wrong result on shape X" in user and "previous attempt" in user
    assert "blackwell" in msgs[0]["content"]
    assert extract_code("text\n```python\nclass ModelNew: pass\n```\nmore") == "class ModelNew: pass\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nimport torch\nclass ModelNew:") == "import torch\nclass ModelNew:\n"  # max_tokens


@pytest.mark.slow
def test_generate_end_to_end_with_a_scripted_endpoint(tmp_path):
    from llmkit.kernels.workbench.generate import generate, scripted_endpoint

    wrong = "```python\n" + (FIX / "bad_example_shape.py").read_text() + "```"
    right = "Here:\n```python\n" + (FIX / "good_softmax.py").read_text() + "```"
    with scripted_endpoint([wrong, right]) as url:
        s = generate(FIX / "ref_softmax.py", "hopper", url, "scripted", tmp_path, budget=2, candidates=1,
                     parallel=1, trials=1, progress=False)
        second_prompt = url.requests[1]["messages"][1]["content"]
    assert s["n_candidates"] == 2 and s["n_correct"] == 1 and s["best"]["round"] == 1
    assert (tmp_path / "best.py").read_text() == (FIX / "good_softmax.py").read_text().strip() + "\n"
    assert "What went wrong" in second_prompt and "shape" in second_prompt  # the failure was fed back
    rows = [json.loads(x) for x in (tmp_path / "trajectory.jsonl").read_text().splitlines()]
    assert [r["verification"]["correct"] for r in rows] == [False, True]
    assert (tmp_path / "candidates" / "r0_c0.py").is_file() and json.loads((tmp_path / "summary.json").read_text())


def test_parse_source_lets_one_thread_parse_at_a_time(monkeypatch):
    """CPython 3.11's AST conversion keeps its recursion check in state shared by threads; two verify runs in a
    thread pool parsing at once failed with "AST constructor recursion depth mismatch" (seen in a fresh-clone
    `make test`). parse_source serializes the parses."""
    import ast
    import threading
    import time

    from llmkit.kernels.workbench import verify as v

    inside, most, real = [0], [0], ast.parse
    guard = threading.Lock()

    def slow_parse(source, filename="<unknown>"):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # hold the parse long enough for the other threads to try
        with guard:
            inside[0] -= 1
        return real(source, filename=filename)

    monkeypatch.setattr(v.ast, "parse", slow_parse)
    threads = [threading.Thread(target=v.parse_source, args=("x = 1\n",)) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert most[0] == 1
    assert isinstance(v.static_check("class ModelNew: pass\n")[0], list)  # static checks go through it too
