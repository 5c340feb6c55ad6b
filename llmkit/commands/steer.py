"""``llmkit steer``: build a steering vector from contrastive prompt pairs, or try one on a prompt.

    llmkit steer extract --behavior verbosity --questions my/gsm8k_train.jsonl --output vec/
    llmkit steer extract --pairs pairs.jsonl --layers 18 --output vec/
    llmkit steer try --vector vec/ --alpha 4 "How many legs do 3 cats have?"

``--pairs`` is JSONL with one ``{"positive": ..., "negative": ...}`` per line (each side a string or a list
of chat messages). Without it, pairs are the behaviour's built-in instructions applied to the questions of
``--questions`` (a JSONL with a ``question`` field, or a hub dataset id; default ``openai/gsm8k``).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmkit.cli_types import positive_int

DEFAULT_QUESTIONS = "openai/gsm8k"


def _layers(text: str) -> list[int]:
    import argparse

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must be comma-separated integers, got '{text}'") from None


def register(sub):
    p = sub.add_parser("steer", help="steering vectors: extract from contrastive pairs, try on a prompt",
                       description="Build steering vectors (difference of mean hidden states between "
                       "contrastive prompts) and try them.")
    ss = p.add_subparsers(dest="steer_command", metavar="ACTION")
    e = ss.add_parser("extract", help="extract a steering vector from contrastive prompt pairs")
    e.add_argument("--model", default=None, help="model alias, folder or hub id (default: the bundled model)")
    e.add_argument("--behavior", default=None, help="verbosity | confidence | expertise | robustness "
                   "(built-in pairs; also recorded in the vector's metadata)")
    e.add_argument("--pairs", default=None, help="JSONL of {positive, negative} pairs (overrides built-in pairs)")
    e.add_argument("--questions", default=DEFAULT_QUESTIONS,
                   help="JSONL with a 'question' field or a hub dataset id (train split), for the built-in pairs "
                   f"(default: {DEFAULT_QUESTIONS}, GSM8K train)")
    e.add_argument("--num-pairs", type=positive_int, default=64, help="pairs to use (default 64)")
    e.add_argument("--layers", type=_layers, default=None, help="comma-separated decoder layers "
                   "(default: one layer at 60%% depth)")
    e.add_argument("--position", choices=("last", "mean"), default="last",
                   help="read hidden states at the last prompt token or averaged over the prompt")
    e.add_argument("--output", "-o", required=True, help="folder to write steering.safetensors + steering.json")
    e.set_defaults(func=run)
    t = ss.add_parser("try", help="generate with a steering vector at one or more intensities")
    t.add_argument("prompt", help="user message")
    t.add_argument("--vector", required=True, help="folder written by `llmkit steer extract`")
    t.add_argument("--model", default=None, help="model (default: the one the vector was built on, else bundled)")
    t.add_argument("--alpha", type=float, action="append", default=None,
                   help="steering intensity; repeat to compare (default: 0 and 4)")
    t.add_argument("--max-new-tokens", type=positive_int, default=128)
    t.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _read_pairs(path: str, limit: int) -> list[tuple]:
    from llmkit.cli import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such pairs file: {path}")
    pairs = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
        if not isinstance(rec, dict) or not rec.get("positive") or not rec.get("negative"):
            raise UserError(f"{path}:{lineno}: expected an object with non-empty 'positive' and 'negative'")
        pairs.append((rec["positive"], rec["negative"]))
        if len(pairs) >= limit:
            break
    if not pairs:
        raise UserError(f"{path}: no pairs")
    return pairs


def _questions(path: str, limit: int) -> list[str]:
    from llmkit.cli import UserError
    from llmkit.evals.data import load_source

    out = []
    for rec in load_source(path, split="train", config="main" if path == DEFAULT_QUESTIONS else None):
        if not rec.get("question"):
            raise UserError(f"{rec.get('_source', path)}: missing field 'question'")
        out.append(rec["question"])
        if len(out) >= limit:
            break
    return out


def run(args) -> int:
    from llmkit.cli import UserError

    if args.steer_command == "extract":
        from llmkit.rewards.behaviors import BEHAVIORS, contrastive_pairs

        if args.pairs is None and args.behavior is None:
            raise UserError("give --behavior (built-in pairs) or --pairs FILE")
        if args.behavior is not None and args.behavior not in BEHAVIORS:
            raise UserError(f"unknown behaviour '{args.behavior}': choose from {', '.join(BEHAVIORS)}")
        pairs = (_read_pairs(args.pairs, args.num_pairs) if args.pairs
                 else contrastive_pairs(args.behavior, _questions(args.questions, args.num_pairs)))
        from llmkit.models import load
        from llmkit.steering import decoder_layers, extract

        model, tok = load(args.model)
        n = len(decoder_layers(model))
        if args.layers and any(not 0 <= layer < n for layer in args.layers):
            raise UserError(f"--layers {args.layers}: the model has {n} decoder layers (0..{n - 1})")
        vec = extract(model, tok, pairs, layers=args.layers, position=args.position, behavior=args.behavior or "")
        vec.meta["model"] = args.model or vec.meta.get("model", "")
        out = vec.save(args.output)
        norms = ", ".join(f"layer {k}: {v:.3f}" for k, v in vec.norms().items())
        print(f"steering vector from {len(pairs)} pairs ({norms}) saved to {out}")
        return 0

    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.models import load
    from llmkit.steering import SteeringVector, check_compatible, steer

    try:
        vec = SteeringVector.load(args.vector)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    model, tok = load(args.model or vec.meta.get("model") or None)
    try:
        check_compatible(model, vec)
    except ValueError as e:
        raise UserError(f"{args.vector}: {e}") from None
    prompt = chat_prompt(tok, [{"role": "user", "content": args.prompt}])
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    for alpha in args.alpha or [0.0, 4.0]:
        with steer(model, vec, alpha):
            text = generate(model, tok, [prompt], params)[0].text
        print(f"--- alpha {alpha:g}\n{text.strip()}\n")
    return 0
