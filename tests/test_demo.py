"""`make demo` (python -m llmkit.demo) runs every step end to end on the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.bundled
@pytest.mark.slow
def test_demo_runs_every_step(tmp_path, repo_root, shared_data):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "llmkit.demo", "--limit", "2", "--guard-fit", "8",
                           "--train-steps", "2", "--output", str(out)],
                          check=False, cwd=repo_root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in ("1. chat", "2. GSM8K", "3. KV quantization", "4. guarded serving", "5. recipe"):
        assert f"=== {step}" in proc.stdout
    res = json.loads((out / "demo.json").read_text())
    assert res["chat"]["answer"].strip()
    assert res["gsm8k"]["n"] == 2 and set(res["gsm8k"]["metrics"]) >= {"strict_match", "flexible_extract"}
    kv = res["kv_cache"]
    assert kv["prompt_tokens"] > 256 and kv["bf16_bytes"] / kv["kv_bytes"]["total"] > 2.5
    reqs = res["guarded_serving"]["requests"]
    assert [r["setting"] for r in reqs] == ["aligned", "conflict"]
    assert all(isinstance(r["guard"]["score"], float) and r["answer"] for r in reqs)
    assert (out / "guard" / "guard.json").is_file()
    assert res["recipe"]["global_step"] == 2 and (out / "halo" / "halo_results.json").is_file()
