"""The package as a user installs it: a wheel built from this checkout, installed into a fresh virtual
environment, used from a folder outside the checkout with no network (conftest's ``offline_env``).

Offline and fast: the fresh environment gets a ``.pth`` line naming the test interpreter's site-packages for
the dependencies (that folder's own ``.pth`` files, the editable install of this checkout among them, are not
processed from a ``.pth`` line), and the wheel goes in with ``pip install --no-deps --no-index``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.bundled, pytest.mark.slow]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory, repo_root, offline_env):
    """(the fresh environment's bin folder, a working folder outside the checkout, its environment variables)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"  # the build writes build/ and *.egg-info next to the sources: keep them out of the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo_root / name, src / name)
    shutil.copytree(repo_root / "llmkit", src / "llmkit", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          str(src), "-w", str(base / "dist")], env=offline_env)
    wheel = next((base / "dist").glob("llmkit-*.whl"))
    env_dir = base / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    bin_dir = env_dir / "bin"
    purelib = Path(_run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                   .strip())
    (purelib / "_llmkit_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=offline_env)
    work = base / "work"
    work.mkdir()
    return bin_dir, work, {**offline_env, "OMP_NUM_THREADS": "1"}


def test_the_wheel_holds_the_package_and_its_gsm8k_sample(installed):
    bin_dir, work, env = installed
    code = ("import llmkit, llmkit.data as d; print(llmkit.__file__); "
            "print(len((d.GSM8K_SAMPLE / 'test.jsonl').read_text().splitlines())); "
            "print((d.GSM8K_SAMPLE / 'LICENSE').is_file())")
    out = _run([str(bin_dir / "python"), "-c", code], cwd=work, env=env).splitlines()
    assert out[0].startswith(str(bin_dir.parent)) and out[1:] == ["40", "True"]


def test_chat(installed):
    bin_dir, work, env = installed
    out = _run([str(bin_dir / "llmkit"), "chat", "What is 2 + 3?", "--max-new-tokens", "16"], cwd=work, env=env)
    assert out.strip()


def test_eval_gsm8k_on_the_packaged_sample(installed):
    bin_dir, work, env = installed
    sample = _run([str(bin_dir / "python"), "-c", "import llmkit.data as d; print(d.GSM8K_SAMPLE)"],
                  cwd=work, env=env).strip()
    assert sample.startswith(str(bin_dir.parent))
    _run([str(bin_dir / "llmkit"), "eval", "gsm8k", "--limit", "2", "--data", sample, "--max-new-tokens", "16",
          "--output", "run"], cwd=work, env=env)
    summary = json.loads((work / "run" / "summary.json").read_text())["gsm8k"]
    assert summary["n"] == 2 and "flexible_extract" in summary["metrics"]


def test_serve_answers_one_request(installed):
    import httpx

    bin_dir, work, env = installed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(bin_dir / "llmkit"), "serve", "--port", str(port)], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        server.terminate()
        server.wait(timeout=60)
