"""llmkit doctor: the report, the skip logic, each check's CPU path, and a failing check's exit status."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch

from llmkit.doctor import Check, Context, Skip, format_report, run_checks, skip_reason

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check(name="c", gpus=0, cpu_path=False, slow=False, packages=()):
    return Check(name, "test check", lambda ctx: "fine", gpus=gpus, cpu_path=cpu_path, slow=slow, packages=packages)


# ----------------------------------------------------------------------------- skip logic


def test_skip_reasons_follow_devices_packages_quick_and_only():
    assert skip_reason(_check(), gpus=0) is None
    assert skip_reason(_check(gpus=1), gpus=0) == "no CUDA device"
    assert skip_reason(_check(gpus=1), gpus=1) is None
    # a GPU check with a CPU path runs on CPU only when --only names it, and says so otherwise
    gpu_cpu = _check("lqzo", gpus=1, cpu_path=True)
    assert "--only lqzo" in skip_reason(gpu_cpu, gpus=0)
    assert skip_reason(gpu_cpu, gpus=0, explicit={"lqzo"}) is None
    assert skip_reason(_check("x", gpus=1), gpus=0, explicit={"x"}) == "no CUDA device"  # no CPU path
    assert skip_reason(_check(gpus=2), gpus=1) == "needs more than one GPU (found 1)"
    assert skip_reason(_check(gpus=2), gpus=4) is None
    pk = _check(packages=("deepspeed", "torch"))
    assert skip_reason(pk, gpus=0, installed=lambda p: p != "deepspeed") == "deepspeed not installed"
    assert skip_reason(pk, gpus=0, installed=lambda p: True) is None
    slow = _check("s", slow=True)
    assert "--quick" in skip_reason(slow, gpus=0, quick=True)
    assert skip_reason(slow, gpus=0, quick=True, explicit={"s"}) is None


def test_on_a_cpu_machine_every_gpu_check_is_skipped(tmp_path):
    from llmkit.doctor.checks import CHECKS

    gpu_checks = [c for c in CHECKS if c.gpus]
    assert {c.name for c in gpu_checks} >= {"hf_cuda", "vllm_serve", "inquant_triton", "hawkeye_strategies",
                                            "kernels_verify", "qlora", "lqzo", "vspo", "grpo_vllm", "zero2"}
    res = run_checks(gpu_checks, Context(tmp_path, gpus=0))
    assert [r["status"] for r in res] == ["skipped"] * len(gpu_checks)
    assert all(r["reason"] for r in res)


def test_run_checks_reports_ok_failed_and_skip_raised_inside_with_times(tmp_path):
    def boom(ctx):
        raise RuntimeError("the widget is broken\nsecond line")

    def wrong(ctx):
        answer = len("x")
        assert answer == 2, "answer was 1, expected 2"

    def later(ctx):
        raise Skip("no sandbox: bwrap missing")

    seen = []
    checks = [Check("a", "", lambda ctx: f"ran on {ctx.device}"), Check("b", "", boom), Check("c", "", wrong),
              Check("d", "", later), Check("e", "", lambda ctx: "after failures")]
    res = run_checks(checks, Context(tmp_path), progress=seen.append)
    by = {r["name"]: r for r in res}
    assert by["a"]["status"] == "ok" and by["a"]["detail"] == "ran on cpu"
    assert by["b"]["status"] == "failed" and by["b"]["reason"].startswith("RuntimeError: the widget is broken")
    assert by["c"]["status"] == "failed" and by["c"]["reason"] == "answer was 1, expected 2"
    assert by["d"]["status"] == "skipped" and by["d"]["reason"] == "no sandbox: bwrap missing"
    assert by["e"]["status"] == "ok"  # a failure does not stop the rest
    assert [r["name"] for r in seen] == list("abcde")
    assert all(isinstance(r["seconds"], float) for r in res)


# ----------------------------------------------------------------------------- the command


def _run_cli(monkeypatch, capsys, checks, *argv):
    from llmkit.cli import main
    from llmkit.doctor import checks as registry

    monkeypatch.setattr(registry, "CHECKS", checks)
    rc = main(["doctor", *argv])
    return rc, capsys.readouterr()


def test_an_injected_failing_check_gives_exit_1_and_its_reason(monkeypatch, capsys):
    def broken(ctx):
        raise ValueError("widget output was 3, expected 4")

    checks = [Check("fine", "", lambda ctx: "all good"), Check("broken", "", broken)]
    rc, out = _run_cli(monkeypatch, capsys, checks, "--json")
    assert rc == 1
    report = json.loads(out.out)
    assert report["ok"] is False and report["failed"] == ["broken"]
    r = {c["name"]: c for c in report["checks"]}
    assert r["broken"]["status"] == "failed" and "widget output was 3, expected 4" in r["broken"]["reason"]
    assert r["fine"]["status"] == "ok"
    rc, out = _run_cli(monkeypatch, capsys, checks)
    assert rc == 1
    assert "FAILED: ValueError: widget output was 3, expected 4" in out.out
    assert "1 ok, 1 failed, 0 skipped" in out.out


def test_report_json_has_the_environment_and_exit_0_without_failures(monkeypatch, capsys):
    checks = [Check("fine", "", lambda ctx: "all good"), Check("gpu", "", lambda ctx: "x", gpus=1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out = _run_cli(monkeypatch, capsys, checks, "--json")
    assert rc == 0
    report = json.loads(out.out)  # one object, nothing else on stdout
    env = report["environment"]
    for key in ("python", "torch", "cuda", "rocm", "devices", "gpus", "memory_gib", "sandbox"):
        assert key in env
    for pkg in ("vllm", "triton", "bitsandbytes", "deepspeed", "flash_attn", "transformers"):
        assert pkg in env["packages"]
    assert env["packages"]["torch"] == torch.__version__.split("+")[0] or env["packages"]["torch"] == torch.__version__
    assert [c["status"] for c in report["checks"]] == ["ok", "skipped"]
    assert report["checks"][1]["reason"] == "no CUDA device"
    text = format_report(report)
    assert "fine" in text and "skipped: no CUDA device" in text and "sandbox" in text


def test_only_selects_checks_and_rejects_unknown_names(monkeypatch, capsys):
    checks = [Check("one", "", lambda ctx: "1"), Check("two", "", lambda ctx: "2")]
    rc, out = _run_cli(monkeypatch, capsys, checks, "--json", "--only", "two")
    assert rc == 0 and [c["name"] for c in json.loads(out.out)["checks"]] == ["two"]
    rc, out = _run_cli(monkeypatch, capsys, checks, "--only", "two,nope")
    assert rc == 2 and "nope" in out.err and "one, two" in out.err


# ----------------------------------------------------------------------------- the checks' CPU paths


def test_sandbox_check_runs_a_call_and_fails_on_a_wrong_answer(tmp_path, monkeypatch):
    from llmkit.doctor import checks
    from llmkit.tools import sandbox

    if not sandbox.check_available()[0]:
        with pytest.raises(Skip, match="no sandbox"):
            checks.sandbox(Context(tmp_path))
        return
    assert "network blocked" in checks.sandbox(Context(tmp_path))
    monkeypatch.setattr(sandbox, "run_function", lambda *a, **k: sandbox.Result(ok=True, value=[42, "reachable"]))
    with pytest.raises(AssertionError, match="reachable"):
        checks.sandbox(Context(tmp_path))


def test_hf_engine_check_cpu_path_uses_the_inquant_cache_and_a_guard(tmp_path, monkeypatch):
    from llmkit.doctor import checks

    detail = checks.hf_engine(Context(tmp_path, device="cpu"))
    assert "InQuant cache" in detail and "guard scores" in detail


@pytest.mark.slow
def test_hf_engine_check_fails_when_the_cache_never_quantizes(tmp_path, monkeypatch):
    from llmkit.doctor import checks

    # a prompt shorter than one quantization group never reaches the 4-bit store: the check says so
    monkeypatch.setattr(checks, "SYSTEM", "")
    with pytest.raises(AssertionError, match="no packed 4-bit data"):
        checks.hf_engine(Context(tmp_path, device="cpu"))


def test_inquant_comparison_passes_equal_kernels_and_names_a_mismatch():
    from llmkit.doctor.checks import compare_inquant
    from llmkit.kernels import kv_quant as kq

    assert "bit-exact" in compare_inquant("cpu", kq.quantize_pack_ref, kq.dequant_unpack_ref)

    def off_by_one_code(x, role, partner):
        packed, scale, zero = kq.quantize_pack_ref(x, role, partner)
        packed = packed.clone()
        packed.view(-1)[5] ^= 1
        return packed, scale, zero

    with pytest.raises(AssertionError, match="1 of .* packed codes differ"):
        compare_inquant("cpu", off_by_one_code, kq.dequant_unpack_ref)
    with pytest.raises(AssertionError, match="unpack\\+dequantize differs"):
        compare_inquant("cpu", kq.quantize_pack_ref, lambda *a, **k: kq.dequant_unpack_ref(*a, **k) + 1e-3)


def test_inquant_comparison_of_the_triton_kernels_under_the_interpreter(monkeypatch):
    """The check's comparison with the real kernels, run by Triton's interpreter (as tests/serving/kv_cache/test_kernels.py)."""
    import triton

    from llmkit.doctor.checks import compare_inquant
    from llmkit.kernels import kv_quant as kq
    from llmkit.kernels import kv_quant_triton as k
    from llmkit.kernels.workbench.compiled import run_interpreted

    class Interpreted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: run_interpreted(self.kernel, grid, *a, **kw)

    monkeypatch.setattr(kq, "_kernels", lambda: (triton, Interpreted(k.quant_kernel), Interpreted(k.dequant_kernel)))
    assert "bit-exact" in compare_inquant("cpu")


def test_strategy_test_runner_reports_passes_and_names_failures(tmp_path):
    from llmkit.doctor.checks import run_strategy_tests

    (tmp_path / "test_good.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    assert "1 passed" in run_strategy_tests(tmp_path, "hopper", timeout=120)
    (tmp_path / "test_bad.py").write_text(textwrap.dedent("""
        def test_wgmma_present():
            assert "wgmma" in "mma.sync", "wgmma missing from the PTX"
    """))
    with pytest.raises(AssertionError, match="test_bad.py::test_wgmma_present"):
        run_strategy_tests(tmp_path, "hopper", timeout=120)


@pytest.mark.slow  # two verifier subprocesses under Triton's interpreter: ~40 s on a shared CPU
@pytest.mark.xdist_group("kernel_verifier")
def test_kernels_verify_check_cpu_path_accepts_good_and_rejects_bad(tmp_path, monkeypatch, verify_runs):
    from llmkit.doctor import checks
    from llmkit.tools import sandbox

    # the check's two sandboxed runs are the kernel tests' runs with the same arguments, made once (conftest.py)
    monkeypatch.setattr("llmkit.kernels.workbench.verify.verify", verify_runs)
    ctx = Context(tmp_path, device="cpu")
    if not sandbox.check_available()[0]:
        with pytest.raises(Skip, match="no sandbox"):
            checks.kernels_verify(ctx)
        return
    detail = checks.kernels_verify(ctx)
    assert "good kernel accepted" in detail and "zero-output kernel rejected" in detail


@pytest.mark.parametrize("name", ["lqzo", "vspo", "qlora"])
def test_training_checks_cpu_path_two_steps_on_the_tiny_model(name, tmp_path):
    from llmkit.doctor import checks

    detail = getattr(checks, name)(Context(tmp_path, device="cpu"))
    assert detail.startswith("tiny-llama") and "2 steps, loss" in detail


def test_two_steps_logged_names_what_is_wrong(tmp_path):
    from llmkit.doctor.checks import two_steps_logged

    with pytest.raises(AssertionError, match="no checkpoint-2"):
        two_steps_logged(tmp_path)
    (tmp_path / "checkpoint-2").mkdir()
    state = {"global_step": 2, "log_history": [{"loss": 1.5}, {"loss": float("nan")}]}
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(AssertionError, match="nan"):
        two_steps_logged(tmp_path)
    state["log_history"][1]["loss"] = 1.25
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    assert two_steps_logged(tmp_path) == "2 steps, loss 1.500, 1.250"


@pytest.mark.vllm
@pytest.mark.bundled
@pytest.mark.slow
def test_vllm_serve_check_cpu_path(tmp_path):
    from llmkit.doctor import checks

    assert "tokens" in checks.vllm_serve(Context(tmp_path, device="cpu"))


@pytest.mark.slow  # TRL imports vLLM for use_vllm: ~30 s on a shared CPU
def test_grpo_vllm_check_builds_a_grpo_config_with_colocated_vllm_rollouts(tmp_path, monkeypatch):
    """The GPU-only check's arguments parse into the recipe's config (the run itself needs CUDA)."""
    from llmkit.doctor import checks
    from llmkit.train.vspo import recipe

    seen = {}
    monkeypatch.setattr(recipe, "main", lambda *configs: seen.setdefault("configs", configs) and 0)
    with pytest.raises(AssertionError, match="no checkpoint-2"):  # nothing trained: the check says so
        checks.grpo_vllm(Context(tmp_path, device="cuda"))
    cfg = seen["configs"][0]
    assert (cfg.mode, cfg.use_vllm, cfg.vllm_mode, cfg.max_steps, cfg.use_cpu) == ("grpo", True, "colocate", 2, False)


def test_zero2_check_launches_accelerate_with_the_zero2_config_and_quotes_a_failure(tmp_path, monkeypatch):
    from llmkit.doctor import checks

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: NCCL error: unhandled system error\n")

    monkeypatch.setattr(checks.subprocess, "run", fake_run)
    with pytest.raises(AssertionError, match="exited 1: .*NCCL error"):
        checks.zero2(Context(tmp_path, gpus=4, device="cuda"))
    cmd = calls[0]
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1].endswith("recipes/accelerate/zero2.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "4" and cmd[cmd.index("--max_steps") + 1] == "2"


def test_what_checks_print_goes_to_stderr_so_json_stays_one_object(monkeypatch, capfd):
    import os

    from llmkit.cli import main
    from llmkit.doctor import checks as registry

    def chatty(ctx):
        print("{'loss': 1.23}  <- a trainer's log line")
        os.write(1, b"written to fd 1 by C code\n")
        return "done"

    monkeypatch.setattr(registry, "CHECKS", [Check("chatty", "", chatty)])
    assert main(["doctor", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["checks"][0]["detail"] == "done"  # nothing else on stdout
    assert "a trainer's log line" in err and "by C code" in err
    assert main(["doctor"]) == 0
    out, err = capfd.readouterr()
    assert "chatty" in out and "ok" in out and "a trainer's log line" in err
