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
import os
import sys
from pathlib import Path

from llmkit.experiments import serving as S

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
RESULTS = REPO / "bench" / "results"
MODEL = S.MODEL


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
    qs = S.questions(GSM8K, clients * per_client)
    res: dict = {"model": MODEL, "clients": clients, "requests_per_client": per_client, "max_tokens": max_tokens,
                 "sequential_prompts": n_seq, "quick": args.quick}

    import torch

    torch.set_num_threads(args.threads)
    res["threads"] = args.threads
    side_by_side = (args.client_prompts, args.client_input_len, args.client_output_len, args.client_concurrency,
                    args.threads, REPO)
    if args.client_only:
        res = {"model": MODEL, "threads": args.threads, **S.client_side_by_side(*side_by_side)}
        return S.write_results(res, Path(args.out) if args.out else RESULTS / "serving_client.json")
    res.update(S.hf_throughput(qs, clients, per_client, max_tokens, n_seq, args.threads, REPO))
    if not args.skip_vllm:
        res.update(S.vllm_throughput(qs, clients, per_client, max_tokens, REPO))
    else:
        res["vllm_vs_raw_ratio"] = None
    if not args.skip_client and not args.skip_vllm:
        res.update(S.client_side_by_side(*side_by_side))
    out = Path(args.out) if args.out else RESULTS / ("serving_quick.json" if args.quick else "serving.json")
    return S.write_results(res, out)


if __name__ == "__main__":
    sys.exit(main())
