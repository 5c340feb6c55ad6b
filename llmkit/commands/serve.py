"""``llmkit serve``: an OpenAI-compatible HTTP server over the transformers or vLLM engine."""

from __future__ import annotations

from llmkit.cli_types import positive_int


def register(sub):
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. "
        "Works with the openai client (base_url=http://HOST:PORT/v1) and curl. Stop with Ctrl-C or SIGTERM: "
        "in-flight requests finish first.")
    p.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="hf = transformers with request batching (default); vllm = vLLM's engine in-process")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (use 0.0.0.0 to listen on all interfaces)")
    p.add_argument("--port", type=positive_int, default=8000, help="default 8000")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (else 401)")
    p.add_argument("--max-concurrency", type=positive_int, default=64,
                   help="generation requests in flight at once; more are answered 429 (default 64)")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                   help="longest prompt + max_tokens, in tokens (default 2048)")
    p.add_argument("--max-batch-size", type=positive_int, default=32,
                   help="sequences per batch for the hf engine (default 32)")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 for hf, bfloat16 for vllm)")
    p.add_argument("--kv-cache", default=None, metavar="NAME",
                   help="KV-cache implementation for the hf engine, e.g. 'inquant' (default: transformers' dynamic cache)")
    p.add_argument("--guard", default=None, metavar="DIR", help="a fitted guard folder (llmkit guard fit); checks every answer")
    p.add_argument("--guard-action", choices=("annotate", "block", "correct"), default="annotate",
                   help="what to do with flagged answers (default annotate)")
    p.add_argument("--enforce-eager", action="store_true", help="vllm engine: skip graph capture (faster start)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 is often faster on a busy shared CPU")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def build_engine(args):
    """The engine named by the flags; user mistakes raise UserError before anything heavy loads."""
    from llmkit.cli import UserError

    if args.engine == "vllm":
        if args.kv_cache:
            raise UserError("--kv-cache works only with --engine hf (vLLM manages its own KV cache)")
        from llmkit.engines.vllm import VLLMEngine

        kw = {"enforce_eager": True} if args.enforce_eager else {}
        return VLLMEngine(args.model, dtype=args.dtype or "bfloat16", max_model_len=args.max_model_len, **kw)
    cache_factory = None
    if args.kv_cache:
        from llmkit.serving.kv_cache import cache_factory as make_cache_factory

        try:
            cache_factory = make_cache_factory(args.kv_cache)
        except (KeyError, ValueError) as e:
            raise UserError(f"--kv-cache {args.kv_cache}: {e}") from None
    from llmkit.engines.hf import HFEngine

    return HFEngine(args.model, dtype=args.dtype or "float32", cache_factory=cache_factory)


def load_guard(args, model_name: str):
    from llmkit.cli import UserError

    if not args.guard:
        return None
    from llmkit.serving.guard import Guard

    try:
        return Guard.load(args.guard, model_name=model_name)
    except ValueError as e:
        raise UserError(f"--guard {args.guard}: {e}") from None


def run(args) -> int:
    from llmkit.models import DEFAULT_MODEL
    from llmkit.serving.server import ServerConfig, build_app, serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    name = args.served_model_name or args.model or DEFAULT_MODEL
    guard = load_guard(args, name)  # before the engine: a wrong guard folder fails in a second
    engine = build_engine(args)
    cfg = ServerConfig(model_name=name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                       max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                       guard=guard, guard_action=args.guard_action)
    app = build_app(engine, cfg)
    print(f"llmkit serve: model '{name}' on the {engine.name} engine at http://{args.host}:{args.port}/v1 "
          f"(OpenAI-compatible; /health, /metrics)", flush=True)
    try:
        serve(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
