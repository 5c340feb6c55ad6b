"""bench/gpu.py and llmkit.experiments.gpu: the budget plan, the run loop, the CPU rehearsal, the CPU exit."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from llmkit.experiments import gpu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_plan_fits_the_budget_and_never_goes_below_the_floors():
    full = gpu.plan(10_000)
    assert set(full) == set(gpu.MEASUREMENTS)
    assert full["lqzo_int2"]["steps"] == gpu.FULL["lqzo_int2"]["steps"]  # a big budget changes nothing
    assert sum(p["est_s"] for p in gpu.plan(480).values()) <= 480
    small = gpu.plan(120)
    assert sum(p["est_s"] for p in small.values()) < sum(p["est_s"] for p in full.values())
    assert small["lqzo_int2"]["steps"] < full["lqzo_int2"]["steps"]
    assert small["served_throughput"]["num_prompts"] < full["served_throughput"]["num_prompts"]
    tiny = gpu.plan(1, quick=True)
    for name, p in tiny.items():
        for key, floor in gpu.FLOORS.items():
            if key in p:
                assert p[key] >= floor, (name, key)
    assert gpu.plan(480, quick=True)["lqzo_int2"]["steps"] < gpu.plan(480)["lqzo_int2"]["steps"]
    with pytest.raises(ValueError, match="budget"):
        gpu.plan(0)


def test_run_skips_what_no_longer_fits_records_errors_and_saves_after_each(tmp_path, monkeypatch):
    calls = []

    def fine(**kw):
        calls.append(kw)
        return {"arch": "hopper", "kernels": {"k": {"correct": True, "speedup": 2.0, "speedup_vs_compile": 1.1}}}

    def broken(**kw):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu, "FUNCS", {"hawkeye_kernels": fine, "inquant_decode": broken,
                                       "served_throughput": fine, "lqzo_int2": fine})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake H100")
    settings = {n: {"est_s": 1} for n in gpu.MEASUREMENTS}
    settings["lqzo_int2"] = {"est_s": 10_000}  # cannot fit the budget below
    out = tmp_path / "gpu.json"
    lines = []
    res = gpu.run(settings, out, budget_s=60, data_dir="d", log=lines.append)
    r = res["results"]
    assert "kernels" in r["hawkeye_kernels"] and r["inquant_decode"]["error"] == "RuntimeError: CUDA out of memory"
    assert "budget" in r["lqzo_int2"]["skipped"]
    assert json.loads(out.read_text())["results"]["inquant_decode"]["error"].startswith("RuntimeError")
    assert len(lines) == 4 and lines[1].startswith("inquant_decode: RuntimeError")
    assert calls[1]["model"] == gpu.MODEL and "model" not in calls[0]  # kernels take no model
    res = gpu.run(settings, out, budget_s=60, only=["served_throughput"], log=lines.append)
    assert list(res["results"]) == ["served_throughput"]


def test_inquant_decode_cpu_path_on_the_tiny_model(tmp_path):
    from llmkit.models import prepare_model_path

    r = gpu.inquant_decode(prepare_model_path("tiny-llama", tmp_path), contexts=[300], batch=2, new_tokens=4,
                           device="cpu", dtype="float32")
    row = r["rows"][0]
    for arm in ("bf16", "inquant"):
        assert row[arm]["tokens"] == 8 and row[arm]["decode_tok_s"] > 0
    assert r["bytes_per_token"]["held"] < r["bytes_per_token"]["bf16"]  # 4-bit codes + parameters < bf16
    cap = r["capacity_sequences"][300]
    assert cap["inquant"] > cap["bf16"] > 0
    assert "ctx 300" in gpu.summary_line("inquant_decode", r)


def test_summary_lines_name_each_figure():
    serve = {"hf": {"output_throughput": 900.0}, "vllm": {"output_throughput": 3000.0},
             "output_throughput_ratio_hf_vs_vllm": 0.3}
    assert "hf/vllm x0.30" in gpu.summary_line("served_throughput", serve)
    lq = {"steps": 600, "paired_lqzo_minus_qzo": {"mean": -0.02, "std": 0.01, "a_better": 3, "seeds": [0, 1, 2]}}
    assert "LQZO - QZO test loss -0.0200" in gpu.summary_line("lqzo_int2", lq)
    assert gpu.summary_line("lqzo_int2", {"skipped": "budget"}) == "skipped: budget"


@pytest.mark.slow  # importing vLLM's benchmark module takes ~15-30 s here
def test_vllm_bench_client_arguments_parse():
    pytest.importorskip("vllm")
    a = gpu.bench_serve_args("m", "tok", "http://127.0.0.1:9", 64, 512, 128, 16, "/tmp", "hf")
    assert (a.num_prompts, a.random_input_len, a.random_output_len, a.max_concurrency) == (64, 512, 128, 16)
    assert a.ignore_eos and a.endpoint == "/v1/completions" and a.dataset_name == "random"


def test_bench_refuses_bad_arguments(repo_root):
    for args, msg in ((["--only", "nope"], "unknown measurement"), (["--budget-s", "0"], "must be a finite number > 0")):
        p = subprocess.run([sys.executable, "bench/gpu.py", *args], cwd=repo_root, capture_output=True, text=True,
                           timeout=120, check=False)
        assert p.returncode == 2 and msg in p.stderr, p.stderr[-500:]


@pytest.mark.slow  # serves and benchmarks the tiny model: ~1 min on a shared CPU
def test_bench_quick_without_a_gpu_exits_0_naming_every_measurement(repo_root, tmp_path, monkeypatch, capsys):
    # main() in this process rather than the script in a new one (test_bench_refuses_bad_arguments runs the
    # script): torch, transformers and vLLM's benchmark client are imported once per worker, not once more here
    spec = importlib.util.spec_from_file_location("bench_gpu", repo_root / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    spec.loader.exec_module(bench)
    sys.path[:] = path  # the script puts the checkout first, where kernels/ would shadow the `kernels` package
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick", "--gsm8k-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA/ROCm device")
    last = json.loads(out.strip().splitlines()[-1])
    assert last["device"] == "cpu" and last["dry_run"] is True
    assert last["measurements"] == list(gpu.MEASUREMENTS)
    assert last["rehearsal"]["inquant_decode"] == "ok" and last["rehearsal"]["hawkeye_kernels"] == "ok"
    assert "GSM8K" in last["rehearsal"]["lqzo_int2"]  # an empty data folder is named, not hidden
    if importlib.util.find_spec("vllm") is not None:  # the tiny model served by `llmkit serve`, loaded by vLLM's client
        assert last["rehearsal"]["served_throughput"] == "ok"
    assert not (repo_root / "bench" / "results" / "gpu_quick.json").exists()
