"""Serving robustness: 500 malformed or hostile requests fired together with 200 valid ones.

Starts `llmkit serve` (the bundled smollm2-135m-instruct on the hf engine,
with --api-key, --max-model-len 512, --max-concurrency 512, --body-timeout 15 and
--threads 1) as a subprocess, then sends all 700 requests concurrently in
shuffled order, beside them 100 raw-socket hostile clients
(``llmkit.experiments.hostile_http``; the cases are in
``llmkit.experiments.serving_robustness``): a 300 MB declared body of which 1 KB is
sent, a chunked body sent until the server answers, a body that stalls half-way,
and valid requests whose bodies trickle in over about 2 s. Passes when the server process
survives and still answers /health, every malformed request got a 4xx with an
OpenAI error body (413 for oversized bodies, 408 for stalled ones), and every valid
request (max_tokens <= 4, the slow ones included) got 200 with a
choice. Malformed kinds: broken or non-object JSON, absurd nesting, invalid
UTF-8, a 5 MB body, wrong types and out-of-range values in every field,
unknown model, empty messages/prompt, out-of-vocabulary token ids, a prompt
over the context limit, max_tokens over the limit, missing or wrong API key,
unknown path, wrong method, amplification (64 prompts x n=16 = 1024 sequences, and 33 x 16,
against --max-concurrency 512: a 400 at once). Valid ones include hostile-but-legal content
(special-token strings, control characters, emoji, empty content, stop strings).

The server's RSS before and after (generation's batches dominate it) and the most
body bytes a flood got out before its 413 are reported. `--quick` sends 5x fewer of each. Writes bench/results/serving_robustness[_quick].json;
the last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmkit.experiments import serving_robustness as R
from llmkit.experiments.harness import write_json
from llmkit.experiments.serving import MODEL, llmkit_server

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100 malformed + 40 valid")
    args = ap.parse_args(argv)
    n_bad, n_good = (100, 40) if args.quick else (500, 200)
    raw = R.raw_cases(5 if args.quick else 25)
    tagged = R.traffic(n_bad, n_good, seed=0)
    with llmkit_server("hf", R.SERVE_ARGS, REPO) as srv:
        run = R.hammer(srv.url, srv.proc.pid, lambda: srv.proc.poll() is None, tagged, raw)
    res = R.results(tagged, raw, run, model=MODEL)
    R.report(res)
    out = RESULTS / ("serving_robustness_quick.json" if args.quick else "serving_robustness.json")
    write_json(out, res)
    print(f"results: {out}")
    print(json.dumps({k: v for k, v in res.items() if k != "failures"}))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
