"""`make demo` (python -m llmkit.demo) as a user meets it: the package alone, no ../shared beside it, no network.

The demo runs from a copy of ``llmkit/`` in a temporary folder (so nothing above it is the workspace), in the
``offline_env`` of conftest.py: every connection that is not to this machine is refused (the demo's own server is
on 127.0.0.1) and the Hugging Face offline switches are set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def outside(tmp_path_factory, repo_root, offline_env):
    """(folder holding a copy of the package and nothing else, an environment without network that imports it)."""
    base = tmp_path_factory.mktemp("user")
    root = base / "main"
    shutil.copytree(repo_root / "llmkit", root / "llmkit", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**offline_env, "PYTHONPATH": f"{offline_env['PYTHONPATH']}{os.pathsep}{root}"}
    assert not (base / "shared").exists()
    return root, env


def test_the_outside_setup_uses_the_copy_and_has_no_network(outside):
    root, env = outside
    code = ("import socket, llmkit; print(llmkit.__file__)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 443), timeout=2)\n"
            "except OSError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.splitlines()[0] == str(root / "llmkit" / "__init__.py")
    assert "no network in this test" in out


def test_guard_cases_come_from_the_package_unless_iheval_is_given():
    from llmkit.demo import guard_cases

    what, aligned, conflict = guard_cases(None)
    assert "injection set" in what and len(aligned) == len(conflict) == 40
    assert all(s["canary"] and s["messages"][0]["role"] == "system" for s in conflict)
    assert [s["id"] for s in aligned] == [s["id"] for s in conflict]


@pytest.mark.bundled
@pytest.mark.slow
def test_demo_runs_every_step_outside_the_workspace(outside, tmp_path):
    root, env = outside
    out = tmp_path / "demo"
    # at most 16 new tokens a step instead of up to 256 (the KV step keeps its 48), one HALO step: every step
    # still runs end to end
    proc = subprocess.run([sys.executable, "-m", "llmkit.demo", "--limit", "2", "--guard-fit", "8",
                           "--train-steps", "1", "--max-new-tokens", "16", "--output", str(out)],
                          check=False, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no network in this test" not in proc.stdout + proc.stderr
    for step in ("1. chat", "2. GSM8K", "3. KV quantization", "4. guarded serving", "5. recipe"):
        assert f"=== {step}" in proc.stdout
    res = json.loads((out / "demo.json").read_text())
    assert res["chat"]["answer"].strip()
    assert res["gsm8k"]["n"] == 2 and set(res["gsm8k"]["metrics"]) >= {"strict_match", "flexible_extract"}
    assert res["gsm8k"]["max_new_tokens"] == 16
    kv = res["kv_cache"]
    assert kv["prompt_tokens"] > 256 and kv["bf16_bytes"] / kv["kv_bytes"]["total"] > 2.5
    served = res["guarded_serving"]
    assert "injection set" in served["cases"]
    reqs = served["requests"]
    assert [r["setting"] for r in reqs] == ["aligned", "conflict"]
    assert all(isinstance(r["guard"]["score"], float) and r["answer"] for r in reqs)
    assert all(isinstance(r["leaked_secret"], bool) for r in reqs)
    assert (out / "guard" / "guard.json").is_file()
    assert res["recipe"]["global_step"] == 1 and (out / "halo" / "halo_results.json").is_file()


def test_demo_steps_keep_their_generation_lengths_unless_capped(monkeypatch, tmp_path):
    """`make demo` passes no flag: each step generates as much as before; --max-new-tokens only lowers that,
    and not for the KV cache step, whose compression needs its 48 new tokens."""
    import inspect
    import types

    import llmkit.engines.hf
    import llmkit.models
    from llmkit import demo

    engine = types.SimpleNamespace(model=types.SimpleNamespace(num_parameters=lambda: 1), tokenizer=None)
    monkeypatch.setattr(llmkit.engines.hf, "HFEngine", lambda name: engine)
    monkeypatch.setattr(llmkit.models, "materialize_alias", lambda *a, **k: None)
    monkeypatch.setattr(demo, "step_chat", lambda e, n: n)
    monkeypatch.setattr(demo, "step_gsm8k", lambda e, out, limit, n: n)
    kv_default = inspect.signature(demo.step_kv).parameters["max_new_tokens"].default
    monkeypatch.setattr(demo, "step_kv", lambda m, t, n=kv_default: n)
    monkeypatch.setattr(demo, "step_guarded_serving", lambda e, name, out, fit, cases, n: n)
    steps = ("chat", "gsm8k", "kv_cache", "guarded_serving")
    for flags, lengths in (([], [64, 256, 48, 48]), (["--max-new-tokens", "100"], [64, 100, 48, 48]),
                           (["--max-new-tokens", "16"], [16, 16, 48, 16])):
        out = tmp_path / str(len(flags) and flags[1])
        assert demo.main(["--train-steps", "0", "--output", str(out), *flags]) == 0
        res = json.loads((out / "demo.json").read_text())
        assert [res[k] for k in steps] == lengths and "recipe" not in res
