"""``llmkit chat "question"``: one answer from a model."""

from __future__ import annotations

from llmkit.cli_types import positive_int, unit_float


def register(sub):
    p = sub.add_parser("chat", help="answer one question with a model",
                       description="Print a model's answer to one question (chat template applied).")
    p.add_argument("question", help="the user message")
    p.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=unit_float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    from llmkit.cli import UserError
    from llmkit.generation import GenerationParams, chat_prompt, generate
    from llmkit.models import load

    if not args.question.strip():
        raise UserError("the question is empty")
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    model, tok = load(args.model)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.question}
    ]
    params = GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    out = generate(model, tok, [chat_prompt(tok, messages)], params)[0]
    print(out.text.strip())
    return 0
