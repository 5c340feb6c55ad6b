"""``llmkit ldp-proxy``: a local OpenAI-compatible proxy with the LDPCache privacy cache."""

from __future__ import annotations

from llmkit.cli_types import positive_int


def _pos_float(s: str) -> float:
    import argparse
    import math

    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
    return v


def register(sub):
    p = sub.add_parser(
        "ldp-proxy", help="local OpenAI-compatible proxy that answers from an LDP privacy cache",
        description="Apps talk to this proxy instead of the upstream (base_url=http://HOST:PORT/v1). Queries go "
        "upstream only as epsilon-LDP perturbed text; semantically repeated queries are answered from a local "
        "cache by a randomized (LDP) scheduler. Each user (the request's 'user' field) has a privacy budget; "
        "a query that could exceed it is refused with HTTP 429 (code privacy_budget_exceeded). "
        "State (ledger, cache) persists in --state-dir.")
    p.add_argument("--upstream", required=True, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--budget", type=_pos_float, required=True, metavar="EPS",
                   help="total epsilon per user (one query costs about epsilon-per-token x its word pieces)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8100, help="default 8100")
    p.add_argument("--model", default=None, help="upstream model name, replacing what requests name "
                   "(default: the request's model, else the first model the upstream lists)")
    p.add_argument("--api-key", default=None, help="key sent to the upstream")
    p.add_argument("--state-dir", default=None, help="ledger + cache folder (default ~/.cache/llmkit/ldp-proxy)")
    p.add_argument("--epsilon-per-token", type=_pos_float, default=36.0,
                   help="exponential-mechanism epsilon per word piece (default 36: text stays mostly readable)")
    p.add_argument("--rr-epsilon", type=_pos_float, default=3.0, help="epsilon of the hit/miss bit (default 3)")
    p.add_argument("--sim-threshold", type=float, default=0.8, help="cosine similarity for a hit (default 0.8)")
    p.add_argument("--gain-threshold", type=float, default=0.1,
                   help="largest expected accuracy gain of a cloud call still answered from cache (default 0.1)")
    p.add_argument("--capacity", type=positive_int, default=256, help="cache entries per user (default 256)")
    p.add_argument("--eviction", choices=("multifactor", "lru"), default="multifactor")
    p.add_argument("--user", default="default", help="user for requests without a 'user' field")
    p.add_argument("--assistant-turns", choices=("drop", "perturb"), default="drop",
                   help="earlier assistant turns: not sent (default) or perturbed and charged like user text")
    p.add_argument("--length-bucket", type=positive_int, default=None, metavar="N",
                   help="pad each message to a multiple of N word pieces, so only the bucket of its length leaks")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.models import llmkit_home

    if not args.upstream.startswith(("http://", "https://")):
        raise UserError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    if not -1.0 <= args.sim_threshold <= 1.0:
        raise UserError(f"--sim-threshold must be in [-1, 1], got {args.sim_threshold}")
    import uvicorn

    from llmkit.serving.ldp_cache import LDPCache
    from llmkit.serving.ldp_cache.proxy import build_proxy_app

    state = Path(args.state_dir) if args.state_dir else llmkit_home() / "ldp-proxy"
    cache = LDPCache.open(args.upstream, args.budget, state, epsilon_per_token=args.epsilon_per_token,
                          rr_epsilon=args.rr_epsilon, sim_threshold=args.sim_threshold,
                          gain_threshold=args.gain_threshold, capacity=args.capacity, eviction=args.eviction,
                          model=args.model, api_key=args.api_key, assistant_turns=args.assistant_turns,
                          length_bucket=args.length_bucket)
    cache.default_user = args.user
    cache.ledger.default_budget = args.budget
    print(f"llmkit ldp-proxy: http://{args.host}:{args.port}/v1 -> {cache.upstream.url} "
          f"(budget epsilon {args.budget:g} per user, state in {state})", flush=True)
    app = build_proxy_app(cache, force_model=args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
