"""``make demo``: the main job on the bundled default model, step by step.

Each step prints what it does and what it got; results are written under
``runs/demo/``. Run with ``python -m llmkit.demo [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GSM8K_LOCAL = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def step_chat(model_name: str) -> None:
    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.models import load

    say(f"1. chat: loading {model_name} (converted once from the bundled GGUF)")
    t0 = time.time()
    model, tok = load(model_name)
    print(f"loaded in {time.time() - t0:.1f} s: {model.num_parameters() / 1e6:.0f}M parameters")
    q = "Explain in one sentence why the sky is blue."
    out = generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": q}])],
                   GenerationParams(max_new_tokens=64))[0]
    print(f"Q: {q}\nA: {out.text.strip()}")


def step_gsm8k(model_name: str, out_dir: Path, limit: int) -> dict:
    from llmkit.evals import run_eval

    say(f"2. GSM8K check: {limit} test problems, greedy, transformers engine")
    data = str(GSM8K_LOCAL) if GSM8K_LOCAL.is_file() else None
    summary = run_eval("gsm8k", model=model_name, engine="hf", data=data, limit=limit,
                       output=out_dir / "gsm8k")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmkit.demo", description=__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled smollm2-135m-instruct")
    ap.add_argument("--limit", type=int, default=20, help="GSM8K problems (default 20)")
    ap.add_argument("--output", default=str(REPO / "runs" / "demo"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from llmkit.models import DEFAULT_MODEL, materialize_alias

    model_name = args.model or DEFAULT_MODEL
    if model_name == DEFAULT_MODEL:
        materialize_alias(DEFAULT_MODEL, verbose=True)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    step_chat(model_name)
    results = {"gsm8k": step_gsm8k(model_name, out_dir, args.limit)}
    (out_dir / "demo.json").write_text(json.dumps(results, indent=2, default=str))
    say(f"done in {time.time() - t0:.0f} s; results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
