"""The sandbox: normal calls, every attack in the attack set contained, refusal without namespaces, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from llmkit.tools import sandbox
from llmkit.tools.attacks import ATTACK_NAMES, MARGIN_S, run_attacks

pytestmark = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
LIMITS = sandbox.Limits(timeout=2.0, memory_mb=256)


def test_returns_value_stdout_and_errors():
    r = sandbox.run_function("def f(a, b):\n    print('sum', a + b)\n    return [a + b, str(a)]\n", "f",
                             {"a": 2, "b": 3})
    assert r.ok and r.value == [5, "2"] and r.stdout == "sum 5\n" and not r.timed_out
    assert set(r.to_json()) == {"ok", "value", "error", "stdout", "timed_out", "wall_s"}
    r = sandbox.run_function("def f(x):\n    return 1 / x\n", "f", [0])
    assert not r.ok and r.error.startswith("ZeroDivisionError")
    r = sandbox.run_function("def f(:\n", "f", {})
    assert not r.ok and "SyntaxError" in r.error
    rs = sandbox.run_calls("def f(x):\n    return x * x\n", "f", [[1], [2], {"x": 3}])
    assert [r.value for r in rs] == [1, 4, 9]


@pytest.fixture(scope="module")
def outcomes():
    return {o.name: o for o in run_attacks(limits=LIMITS)}


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_is_contained(outcomes, name):
    o = outcomes[name]
    assert o.contained, f"{name}: {o.detail}"
    # on a loaded host the allowance grows by what a call doing nothing costs then (see attacks._allowed_s)
    assert LIMITS.timeout + MARGIN_S <= o.allowed_s and o.wall_s <= o.allowed_s


@pytest.mark.parametrize("idle_s, contained", [(0.0, False), (0.7, True)])
def test_an_overrun_is_excused_only_when_an_idle_call_is_as_slow(monkeypatch, idle_s, contained):
    """The time verdict with the sandbox stubbed: an attack call 0.2 s over its bound is an escape when a call
    doing nothing is quick (an idle host), and is not when that call is slower still (a loaded host)."""
    from llmkit.tools import attacks

    def stub(code, function, args=None, limits=None, *, unsafe=False):
        time.sleep(idle_s if code == attacks._IDLE else 0.3)
        return sandbox.Result(ok=True, value=["FileNotFoundError"] * 4)

    monkeypatch.setattr(attacks, "run_function", stub)
    monkeypatch.setattr(attacks, "MARGIN_S", 0.0)  # the bound is then the 0.1 s timeout: the test sleeps little
    (o,) = run_attacks(("read_host_tmp",), sandbox.Limits(timeout=0.1))
    assert o.contained is contained, o.detail
    assert ("took" in o.detail) is not contained
    assert o.wall_s >= 0.3 and (o.wall_s <= o.allowed_s) is contained


def test_attacks_fail_for_the_right_reason(outcomes):
    # the probes ran (ok) and got errors from the sandbox, not from a crash of the probe itself
    assert outcomes["read_host_tmp"].result.value == ["FileNotFoundError"] * 4
    assert outcomes["socket_localhost"].result.ok
    assert not any(v.startswith("connected") for v in outcomes["socket_localhost"].result.value)
    assert outcomes["infinite_loop"].result.timed_out
    n, err = outcomes["fill_disk"].result.value
    assert err is not None and n <= 40  # stopped by the tmpfs size / RLIMIT_FSIZE (32 MiB, 16 MiB)
    env, _raw = outcomes["read_env"].result.value
    assert set(env) <= {"PATH", "HOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PWD", "LC_CTYPE"}
    assert not outcomes["memory_bomb"].result.ok
    assert len(outcomes["gigabytes_of_output"].result.stdout) <= LIMITS.output_bytes


def test_host_stays_responsive_after_attacks(outcomes):
    t0 = time.perf_counter()
    r = sandbox.run_function("def f():\n    return 7\n", "f")
    assert r.ok and r.value == 7 and time.perf_counter() - t0 < 5


def test_refuses_without_namespaces_unless_unsafe(monkeypatch):
    monkeypatch.setattr(sandbox, "check_available", lambda: (False, "user namespaces are unavailable"))
    with pytest.raises(sandbox.SandboxUnavailable, match="user namespaces are unavailable.*unsafe"):
        sandbox.run_function("def f():\n    return 1\n", "f")
    r = sandbox.run_function("import os\ndef f():\n    return sorted(os.environ)\n", "f", unsafe=True)
    assert r.ok and "LLMKIT_ATTACK_SECRET" not in r.value and "PATH" in r.value


class _P:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture()
def _cli(capsys):
    from llmkit.cli import main

    def run(*args):
        try:
            rc = main(["tools", *args])
        except SystemExit as e:  # argparse errors
            rc = e.code
        out = capsys.readouterr()
        return _P(rc, out.out, out.err)
    return run


def test_cli_exec_as_a_process(tmp_path):
    code = tmp_path / "tool.py"
    code.write_text("def f(a, b):\n    return a - b\n")
    p = subprocess.run([sys.executable, "-m", "llmkit.cli", "tools", "exec", "--code", str(code), "--function", "f",
                        "--args", "[5, 3]"], check=False, capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["value"] == 2


def test_cli_exec_prints_one_json_object(tmp_path, _cli):
    code = tmp_path / "tool.py"
    code.write_text("def double(x):\n    print('x is', x)\n    return 2 * x\n")
    p = _cli("exec", "--code", str(code), "--function", "double", "--args", '{"x": 21}')
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert list(out) == ["ok", "value", "error", "stdout", "timed_out", "wall_s"]
    assert out["ok"] and out["value"] == 42 and out["stdout"] == "x is 21\n" and out["error"] is None
    # the code failing is still exit 0; bad input to the command is exit 2 with one line
    p = _cli("exec", "--code", str(code), "--function", "double", "--args", "[]", "--timeout", "2")
    assert p.returncode == 0 and "TypeError" in json.loads(p.stdout)["error"]
    loop = tmp_path / "loop.py"
    loop.write_text("def f():\n    while True:\n        pass\n")
    t0 = time.perf_counter()
    p = _cli("exec", "--code", str(loop), "--function", "f", "--timeout", "1")
    assert p.returncode == 0 and json.loads(p.stdout)["timed_out"] and time.perf_counter() - t0 < 15
    for bad in (["--args", "{oops"], ["--args", "3"], ["--function", "not-a-name"], ["--timeout", "0"]):
        argv = ["exec", "--code", str(code), "--function", "double", "--args", "{}", *bad]
        p = _cli(*argv)
        assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, (bad, p.stderr)
    p = _cli("exec", "--code", str(tmp_path / "missing.py"), "--function", "f")
    assert p.returncode == 2 and "missing.py" in p.stderr


def test_spawn_python_binds_only_what_it_is_given(tmp_path):
    """spawn_python (the kernel verifier's entry): a bound host folder is readable, nothing else of the host is,
    the environment holds only what was set, and the result pipe carries the answer."""
    import os

    lib, hidden, indir = tmp_path / "lib", tmp_path / "hidden", tmp_path / "in"
    for d in (lib, hidden, indir):
        d.mkdir()
    (lib / "shared.txt").write_text("visible")
    (hidden / "secret.txt").write_text("s3cret")
    prog = lib / "prog.py"
    prog.write_text(
        "import json, os, sys\n"
        "def read(p):\n"
        "    try:\n        return open(p).read()\n"
        "    except OSError:\n        return None\n"
        f"out = {{'lib': read({str(lib / 'shared.txt')!r}), 'hidden': read({str(hidden / 'secret.txt')!r}),\n"
        "       'env': sorted(os.environ), 'mine': os.environ.get('MINE'), 'work': sys.argv[1],\n"
        "       'line': sys.stdin.readline().strip()}\n"
        "os.write(int(sys.argv[2]), json.dumps(out).encode())\n")
    for d in (lib, tmp_path):
        os.chmod(d, 0o755)
    os.environ["LLMKIT_TEST_SECRET_ENV"] = "x"
    try:
        with sandbox.spawn_python(str(prog), ["{work}", "{result_fd}"], str(indir), LIMITS, ro_binds=[str(lib)],
                                  env={"MINE": "{work}/m"}) as sp:
            sp.proc.stdin.write(b"hello\n")
            sp.proc.stdin.flush()
            out = json.loads(sp.results.read().decode())
            assert sp.proc.wait(timeout=10) == 0, sp.log_tail()
    finally:
        del os.environ["LLMKIT_TEST_SECRET_ENV"]
    assert out["lib"] == "visible" and out["hidden"] is None and out["line"] == "hello"
    assert out["work"] == "/sandbox/work" and out["mine"] == "/sandbox/work/m"
    assert "LLMKIT_TEST_SECRET_ENV" not in out["env"] and set(out["env"]) <= {
        "PATH", "HOME", "PWD", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "MINE", "LC_CTYPE"}


def test_bwrap_argv_binds_gpu_device_nodes_and_nothing_else_of_dev():
    argv = sandbox._bwrap_argv("bwrap", "/x/in", LIMITS, ro_binds=["/opt/lib"], devices=["/dev/nvidia0", "/dev/kfd"],
                               env={"A": "1"}, program=("/opt/lib/p.py", "arg"))
    s = " ".join(argv)
    assert "--dev-bind /dev/nvidia0 /dev/nvidia0" in s and "--dev-bind /dev/kfd /dev/kfd" in s
    assert "--ro-bind /opt/lib /opt/lib" in s and "--setenv A 1" in s and argv[-2:] == ["/opt/lib/p.py", "arg"]
    assert argv.count("--dev-bind") == 2 and "--dev /dev" in s  # a fresh /dev plus the GPU nodes
    assert sandbox._bwrap_argv("bwrap", "/x/in", LIMITS)[-1] == "/sandbox/in/runner.py"  # SMITH's call unchanged
    assert all(p.startswith(("/dev/nvidia", "/dev/kfd", "/dev/dri/")) for p in sandbox.gpu_device_nodes())
