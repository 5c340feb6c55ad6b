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


_SENT = ("the perturbed text of each system/developer/user/tool message (and of assistant turns with "
         "--assistant-turns perturb) with its role; with --question-bank the whole conversation goes as one "
         "user message, the public question released for it")
_KEPT = ("message 'name', 'tool_calls', 'tool_call_id' and any other message key; the request's 'stop' "
         "strings, 'tools', 'tool_choice', 'response_format', 'logit_bias', 'logprobs' and every other field "
         "not listed as sent (each answer's ldp.dropped names them)")
_KEY_ENV = "LLMKIT_PROXY_API_KEY"


def register(sub):
    import argparse
    import textwrap

    p = sub.add_parser(
        "ldp-proxy", help="local OpenAI-compatible proxy that answers from an LDP privacy cache",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Apps talk to this proxy instead of the upstream (base_url=http://HOST:PORT/v1). Queries go\n"
        "upstream only as epsilon-LDP perturbed text; semantically repeated queries are answered from a local\n"
        "cache by a randomized (LDP) scheduler. Each user (the request's 'user' field) has a privacy budget;\n"
        "a query that could exceed it is refused with HTTP 429 (code privacy_budget_exceeded).\n"
        "State (ledger, cache) persists in --state-dir.\n\n"
        "Privacy setting (required, one of):\n"
        "  --question-bank FILE   sentence-level: each query is released as one question of a public bank,\n"
        "                         --query-epsilon (default 6) per query, whatever its length (recommended)\n"
        "  --epsilon-per-token E  token-level: a query of n word pieces costs n x E (a 20-piece query at\n"
        "                         E=36 costs 720: no meaningful guarantee for a sentence)\n\n"
        + textwrap.fill(f"Sent upstream: {_SENT}; the model name (--model, else a name the upstream lists); "
                        "the sampling numbers max_tokens, max_completion_tokens, temperature, top_p, seed, "
                        "presence_penalty, frequency_penalty.", 100) + "\n"
        + textwrap.fill(f"Never sent (dropped): {_KEPT}.", 100) + "\n\n"
        "Every answer reports the epsilon it cost and the budget left: the 'ldp' field (epsilon, spent,\n"
        "remaining, budget) and the X-LDP-Epsilon / X-LDP-Spent / X-LDP-Remaining / X-LDP-Budget headers.")
    p.add_argument("--upstream", required=True, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--budget", type=_pos_float, required=True, metavar="EPS",
                   help="total epsilon per user (a cloud call costs --query-epsilon, or epsilon-per-token x its "
                   "word pieces; the hit/miss bit costs --rr-epsilon)")
    p.add_argument("--question-bank", default=None, metavar="FILE",
                   help="public questions for the sentence-level mechanism: a .txt file (one per line) or .jsonl "
                   "(a string or an object with 'question' or 'text' per line); nothing in it may be private")
    p.add_argument("--query-epsilon", type=_pos_float, default=6.0, metavar="EPS",
                   help="epsilon per cloud call of the sentence-level mechanism (default 6)")
    p.add_argument("--epsilon-per-token", type=_pos_float, default=None, metavar="E",
                   help="use the token-level mechanism instead, at E per word piece (no default)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=positive_int, default=8100, help="default 8100")
    p.add_argument("--model", default=None, help="upstream model name, replacing what requests name "
                   "(default: the request's model if the upstream lists it, else the first model it lists)")
    p.add_argument("--api-key", default=None, help="key sent to the upstream")
    p.add_argument("--proxy-api-key", default=None, metavar="KEY",
                   help="key clients must send (Authorization: Bearer KEY); other requests get 401. Default: "
                   f"${_KEY_ENV} if set, else no authentication. Prefer the variable: other local users can "
                   "read command lines")
    p.add_argument("--state-dir", default=None, help="ledger + cache folder (default ~/.cache/llmkit/ldp-proxy)")
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
                   help="token mechanism only: pad each message to a multiple of N word pieces, so only the "
                   "bucket of its length leaks")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def load_question_bank(path) -> list[str]:
    """The public questions in ``path`` (.txt: one per line; .jsonl: strings or {question|text}), deduplicated."""
    import json
    from pathlib import Path

    from llmkit.cli import UserError

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--question-bank: no such file: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except ValueError:
                raise UserError(f"--question-bank: {path} line {n} is not JSON") from None
            q = row if isinstance(row, str) else row.get("question", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(q, str) or not q.strip():
                raise UserError(f"--question-bank: {path} line {n} has no 'question' or 'text' string")
            line = q.strip()
        out.append(line)
    out = list(dict.fromkeys(out))
    if len(out) < 2:
        raise UserError(f"--question-bank: {path} holds {len(out)} distinct questions; the mechanism needs at least 2")
    return out


def describe_privacy(mechanism, rr_epsilon: float, budget: float, source: str = "") -> str:
    """What the chosen setting means, in words a user can check (printed at start-up)."""
    import math

    from llmkit.serving.ldp_cache.sentence import CandidateMechanism

    bit = (f"the cache's hit/miss bit costs {rr_epsilon:g} per query (randomized response: each outcome at most "
           f"e^{rr_epsilon:g} = {math.exp(rr_epsilon):.3g} times likelier under one query than under another)")
    if isinstance(mechanism, CandidateMechanism):
        eps, k = mechanism.epsilon, mechanism.k
        p = math.exp(eps) / (math.exp(eps) + k - 1)
        return (f"privacy: sentence-level mechanism over {k} public questions{source}; a cloud call releases one "
                f"of them for the whole conversation at epsilon {eps:g} per query: any two queries, of any length, "
                f"make each release at most e^{eps:g} = {math.exp(eps):.3g} times likelier; the nearest question is "
                f"sent with probability {p:.2f}, another one at random otherwise"
                + (" (under half the time: a smaller bank or a larger --query-epsilon raises it)" if p < 0.5 else "")
                + f"; {bit}; a budget of {budget:g} pays for about {budget / (eps + rr_epsilon):.3g} cloud calls")
    e = mechanism.epsilon_per_token
    return (f"privacy: token-level mechanism at epsilon {e:g} per word piece: a 20-piece query costs {20 * e:g}, "
            f"and only queries of the same length are protected, each pair up to a factor e^{20 * e:g}"
            + (" -- no meaningful guarantee for a sentence" if 20 * e > 10 else "")
            + f"; {bit}; a budget of {budget:g} pays for about {budget / (20 * e + rr_epsilon):.3g} 20-piece calls")


def run(args) -> int:
    import os
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.models import llmkit_home

    if not args.upstream.startswith(("http://", "https://")):
        raise UserError(f"--upstream must be an http(s) URL, got {args.upstream!r}")
    if not -1.0 <= args.sim_threshold <= 1.0:
        raise UserError(f"--sim-threshold must be in [-1, 1], got {args.sim_threshold}")
    if (args.question_bank is None) == (args.epsilon_per_token is None):
        raise UserError("ldp-proxy needs one privacy setting: --question-bank FILE (sentence-level, "
                        f"--query-epsilon {args.query_epsilon:g} per query, recommended) or --epsilon-per-token E "
                        "(token-level: a query of n word pieces costs n x E)"
                        + ("; not both" if args.question_bank is not None else ""))
    if args.length_bucket is not None and args.epsilon_per_token is None:
        raise UserError("--length-bucket applies to --epsilon-per-token (the token mechanism) only")
    key = args.proxy_api_key if args.proxy_api_key is not None else os.environ.get(_KEY_ENV)
    if key is not None and not key.strip():
        raise UserError(f"--proxy-api-key / ${_KEY_ENV} is empty")
    bank = load_question_bank(args.question_bank) if args.question_bank is not None else None
    import uvicorn

    from llmkit.serving.ldp_cache import LDPCache
    from llmkit.serving.ldp_cache.embedder import MiniLMEmbedder
    from llmkit.serving.ldp_cache.proxy import build_proxy_app

    state = Path(args.state_dir) if args.state_dir else llmkit_home() / "ldp-proxy"
    cache = LDPCache.open(args.upstream, args.budget, state, question_bank=bank, query_epsilon=args.query_epsilon,
                          epsilon_per_token=args.epsilon_per_token, embedder=MiniLMEmbedder(),
                          rr_epsilon=args.rr_epsilon, sim_threshold=args.sim_threshold,
                          gain_threshold=args.gain_threshold, capacity=args.capacity, eviction=args.eviction,
                          model=args.model, api_key=args.api_key, assistant_turns=args.assistant_turns,
                          length_bucket=args.length_bucket)
    cache.default_user = args.user
    cache.ledger.default_budget = args.budget
    print(f"llmkit ldp-proxy: http://{args.host}:{args.port}/v1 -> {cache.upstream.url} "
          f"(budget epsilon {args.budget:g} per user, state in {state})", flush=True)
    src = f" from {args.question_bank}" if bank is not None else ""
    print(describe_privacy(cache.mechanism, args.rr_epsilon, args.budget, src), flush=True)
    print("clients must send Authorization: Bearer <proxy key>" if key else
          f"no --proxy-api-key: anyone who can reach {args.host}:{args.port} can spend and read this budget",
          flush=True)
    app = build_proxy_app(cache, force_model=args.model, proxy_api_key=key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
