"""``llmkit serve``: an OpenAI-compatible HTTP server over the transformers or vLLM engine."""

from __future__ import annotations

from llmkit.cli_types import positive_float, positive_int


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
                   help="sequences generating at once, counting each request as its prompts x n; a request that "
                   "would exceed what is free is answered 429, one asking for more than the whole limit 400 "
                   "(default 64)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 << 20,
                   help="largest request body; a larger Content-Length is answered 413 before any of it is read, "
                   "and a chunked body stops being read at the limit (default 4 MiB)")
    p.add_argument("--body-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="a request body must arrive whole within this; a slower sender is answered 408 (default 30)")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                   help="longest prompt + max_tokens, in tokens (default 2048)")
    p.add_argument("--max-batch-size", type=positive_int, default=32,
                   help="sequences per batch for the hf engine (default 32)")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 for hf, bfloat16 for vllm)")
    p.add_argument("--kv-cache", default=None, metavar="NAME",
                   help="KV-cache implementation for the hf engine: inquant, kivi or outlier-buffer (default: "
                   "transformers' dynamic cache). inquant uses the model's saved calibration (llmkit kv calibrate): "
                   "per-token groups, attention-score gate, continuous batching; without one it says so and uses "
                   "the uncalibrated per-channel cache with static batching")
    p.add_argument("--kv-calibration", default=None, metavar="FILE",
                   help="--kv-cache inquant: this calibration file instead of the model's default one")
    p.add_argument("--guard", default=None, metavar="DIR", help="a fitted guard folder (llmkit guard fit); checks every answer")
    p.add_argument("--guard-action", choices=("annotate", "block", "correct"), default="annotate",
                   help="what to do with flagged answers (default annotate): annotate adds the verdict, block "
                   "refuses, correct regenerates with the system instruction re-asserted and checks the new answer "
                   "(refused if it is flagged too; the verdict's correction says which)")
    p.add_argument("--enforce-eager", action="store_true", help="vllm engine: skip graph capture (faster start)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served beside the base model, each a model name in /v1/models "
                   "(vLLM's syntax; also JSON '{\"name\": ..., \"path\": ...}'). hf engine: PEFT named adapters, "
                   "one per request row; vllm engine: enable_lora + LoRARequest. Without --model the base model is "
                   "the first adapter's base_model_name_or_path")
    p.add_argument("--enable-lora", action="store_true", help="accepted for vLLM compatibility (implied by --lora-modules)")
    p.add_argument("--max-lora-rank", type=positive_int, default=None,
                   help="vllm engine: largest adapter rank (default: from the adapters' configs)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (file or the template text) used instead of the tokenizer's")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from its folder/hub")
    p.add_argument("--device", default=None,
                   help="hf engine: where the model runs: cpu (default), cuda, cuda:N, mps, or 'auto' "
                   "(accelerate's device_map='auto' across the visible GPUs)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=None,
                   help="vllm engine: GPUs to shard the model over (vLLM's tensor_parallel_size)")
    p.add_argument("--pipeline-parallel-size", type=positive_int, default=None,
                   help="vllm engine: pipeline stages (vLLM's pipeline_parallel_size)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vllm engine: fraction of GPU memory vLLM may take (vLLM's default 0.9)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice); 1 is often faster on a busy shared CPU")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def parse_lora_modules(items) -> dict[str, str]:
    """``name=path`` (or vLLM's JSON form) -> ``{name: path}``; each path must be a PEFT adapter folder."""
    import json
    from pathlib import Path

    from llmkit.cli import UserError

    out: dict[str, str] = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--lora-modules {item!r}: the JSON form needs \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise UserError(f"--lora-modules {item!r}: write NAME=PATH (e.g. math=outputs/halo-lora)")
        if name in out:
            raise UserError(f"--lora-modules: the name '{name}' is given twice")
        if not (Path(path) / "adapter_config.json").is_file():
            raise UserError(f"--lora-modules {name}={path}: no adapter_config.json there (not a PEFT adapter folder)")
        out[name] = str(path)
    return out


def adapter_base(path: str) -> str | None:
    """The base model an adapter folder names (``base_model_name_or_path``)."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None


def _chat_template(value: str | None) -> str | None:
    from pathlib import Path

    from llmkit.cli import UserError

    if value is None:
        return None
    p = Path(value)
    if "{" not in value and not p.is_file():
        raise UserError(f"--chat-template {value}: no such file (give a file or the template text itself)")
    return p.read_text() if "{" not in value else value


def build_engine(args, **hf_kw):
    """The engine named by the flags (``llmkit serve`` and ``llmkit eval`` share them); user mistakes raise
    UserError before anything heavy loads. ``hf_kw`` go to the hf engine (eval's batch size)."""
    from llmkit.cli import UserError

    loras = parse_lora_modules(getattr(args, "lora_modules", None))
    template = _chat_template(getattr(args, "chat_template", None))
    if loras and not args.model:
        args.model = adapter_base(next(iter(loras.values())))
    trust = bool(getattr(args, "trust_remote_code", False))
    if args.engine == "vllm":
        if args.kv_cache:
            raise UserError("--kv-cache works only with --engine hf (vLLM manages its own KV cache)")
        if getattr(args, "device", None):
            raise UserError("--device works only with --engine hf (vLLM places the model itself; "
                            "use --tensor-parallel-size to shard it over GPUs)")
        from llmkit.engines.vllm import VLLMEngine

        kw = {"enforce_eager": True} if args.enforce_eager else {}
        for flag, key in (("tensor_parallel_size", "tensor_parallel_size"),
                          ("pipeline_parallel_size", "pipeline_parallel_size"),
                          ("gpu_memory_utilization", "gpu_memory_utilization"), ("max_lora_rank", "max_lora_rank")):
            if getattr(args, flag, None) is not None:
                kw[key] = getattr(args, flag)
        if trust:
            kw["trust_remote_code"] = True
        engine = VLLMEngine(args.model, dtype=args.dtype or "bfloat16", max_model_len=args.max_model_len,
                            lora_modules=loras or None, **kw)
        if template is not None:
            engine.tokenizer.chat_template = template
        return engine
    for flag in ("tensor_parallel_size", "pipeline_parallel_size", "gpu_memory_utilization", "max_lora_rank"):
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag.replace('_', '-')} works only with --engine vllm "
                            "(the hf engine takes --device cuda or --device auto)")
    if getattr(args, "kv_calibration", None) and (args.kv_cache or "").lower() != "inquant":
        raise UserError("--kv-calibration works only with --kv-cache inquant")
    cache_factory = None
    if args.kv_cache:
        from llmkit.serving.kv_cache import cache_factory as make_cache_factory

        try:
            cache_factory = make_cache_factory(args.kv_cache)
        except (KeyError, ValueError) as e:
            raise UserError(f"--kv-cache {args.kv_cache}: {e}") from None
    from llmkit.engines.hf import HFEngine

    device = getattr(args, "device", None)
    kw = {"device_map": "auto"} if device == "auto" else {"device": device or "cpu"}
    if device and device not in ("auto", "cpu"):
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {device}: torch sees no CUDA device here")
    engine = HFEngine(args.model, dtype=args.dtype or "float32", cache_factory=cache_factory, trust_remote_code=trust,
                      **kw, **hf_kw)
    if template is not None:
        engine.tokenizer.chat_template = template
    if args.kv_cache and args.kv_cache.lower() == "inquant":
        import sys

        from llmkit.serving.kv_cache import inquant_serving_factory

        try:
            engine.cache_factory, msg = inquant_serving_factory(engine.model, getattr(args, "kv_calibration", None))
        except ValueError as e:
            raise UserError(f"--kv-cache inquant: {e}") from None
        print(msg, file=sys.stderr, flush=True)
    if loras:
        try:
            engine.load_adapters(loras)
        except (ValueError, OSError) as e:
            raise UserError(f"--lora-modules: {e}") from None
    return engine


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
    from llmkit.cli import UserError
    from llmkit.models import DEFAULT_MODEL
    from llmkit.serving.server import ServerConfig, build_app, serve

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.guard and args.lora_modules:
        raise UserError("--guard and --lora-modules cannot be combined: a guard is fitted on one model's hidden "
                        "states, and the adapters change them")
    loras = parse_lora_modules(args.lora_modules)  # fails fast on a wrong folder
    if loras and not args.model:
        args.model = adapter_base(next(iter(loras.values())))
    name = args.served_model_name or args.model or DEFAULT_MODEL
    guard = load_guard(args, name)  # before the engine: a wrong guard folder fails in a second
    engine = build_engine(args)
    cfg = ServerConfig(model_name=name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                       max_model_len=args.max_model_len, max_batch_size=args.max_batch_size,
                       max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                       guard=guard, guard_action=args.guard_action)
    app = build_app(engine, cfg)
    extra = f" + adapters {', '.join(loras)}" if loras else ""
    print(f"llmkit serve: model '{name}'{extra} on the {engine.name} engine at http://{args.host}:{args.port}/v1 "
          f"(OpenAI-compatible; /health, /metrics)", flush=True)
    try:
        serve(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
