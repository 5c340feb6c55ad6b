"""``llmkit guard fit|score``: fit an AEO hidden-state guard, score responses.

Both read JSONL where each line holds ``messages`` (OpenAI chat format) whose last
message is the assistant's response; other keys are kept in ``score``'s output. For
``fit`` a line may also carry ``"violation": true|false`` (default false): the
unsupervised scores (energy, entropic) fit on the compliant lines only, the supervised
ones (probe, combined) need both kinds.
"""

from __future__ import annotations

import argparse

from llmkit.cli_types import positive_int, unit_float


def _layers(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{s}' is not a comma-separated list of layer ids") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"'{s}': layer ids must be >= 0")
    return sorted(set(ids))


def register(sub):
    p = sub.add_parser("guard", help="AEO hidden-state guard against instruction injection",
                       description="Fit a guard on example responses, then score responses with it "
                       "(chaos score or probe on the response's hidden states; see llmkit.serving.guard).")
    gsub = p.add_subparsers(dest="guard_command", metavar="fit|score", required=True)

    f = gsub.add_parser("fit", help="fit a guard on example responses",
                        description="Fit a guard: JSONL lines with 'messages' ending with the assistant's response "
                        "and, optionally, \"violation\": true|false (default false). energy/entropic learn the "
                        "compliant manifold from the compliant lines; probe/combined also learn from the violations.")
    f.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    f.add_argument("--data", required=True,
                   help="JSONL of conversations; a line may carry \"violation\": true|false (default false)")
    f.add_argument("--out", required=True, help="folder to write guard.safetensors + guard.json to")
    f.add_argument("--layers", type=_layers, default=None,
                   help="comma-separated hidden-state indices (0 = embeddings; default: 4 over the second half)")
    f.add_argument("--components", type=positive_int, default=32, help="principal directions per layer (32)")
    f.add_argument("--target-fpr", type=unit_float, default=0.05,
                   help="false-positive rate on held-out compliant data that sets the threshold (0.05)")
    f.add_argument("--holdout", type=unit_float, default=0.3, help="fraction held out for calibration (0.3)")
    f.add_argument("--score", choices=["energy", "entropic", "probe", "combined"], default="entropic",
                   help="entropic (asymmetric entropic divergence; the default: the best worst-case AUROC on sources "
                   "it was not fitted on in bench/guard.py) or energy (Mahalanobis energy): fitted on the compliant "
                   "lines only; probe (linear probe on the guard layers' pooled states) or combined (energy + probe, "
                   "combined on held-out lines): need lines with \"violation\": true and false")
    f.add_argument("--window", type=positive_int, default=64,
                   help="response tokens per scoring window; a response's score is its highest window's (64)")
    f.add_argument("--max-length", type=positive_int, default=1024,
                   help="tokens per forward pass; a longer conversation keeps its system prompt and latest turns "
                   "(1024)")
    f.add_argument("--batch-size", type=positive_int, default=8)
    f.add_argument("--seed", type=int, default=0)
    f.set_defaults(func=run)

    s = gsub.add_parser("score", help="score responses with a fitted guard",
                        description="Add 'score' and 'flagged' to each JSONL line ('messages' ending with the "
                        "assistant's response).")
    s.add_argument("--guard", required=True, help="folder written by `llmkit guard fit`")
    s.add_argument("--input", required=True, help="JSONL of conversations to score")
    s.add_argument("--output", default=None, help="output JSONL (default: <input>.guard.jsonl)")
    s.add_argument("--model", default=None, help="model to score with (default: the one the guard was fitted on)")
    s.add_argument("--batch-size", type=positive_int, default=8)
    s.set_defaults(func=run)


def read_conversations(path: str) -> list[dict]:
    """JSONL rows, each with a valid ``messages`` list ending with the assistant; errors name file:line."""
    import json
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.serving.guard import split_conversation

    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such file: {path}")
    rows = []
    with p.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "messages" not in row:
                raise UserError(f"{path}:{n}: expected an object with a 'messages' list")
            msgs = row["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
                raise UserError(f"{path}:{n}: 'messages' must be a list of {{role, content}} objects")
            try:
                split_conversation(msgs)
            except ValueError as e:
                raise UserError(f"{path}:{n}: {e}") from None
            if "violation" in row and not isinstance(row["violation"], bool):
                raise UserError(f"{path}:{n}: 'violation' must be true or false, got {row['violation']!r}")
            rows.append(row)
    if not rows:
        raise UserError(f"{path}: no conversations in the file")
    return rows


def run(args) -> int:
    return _fit(args) if args.guard_command == "fit" else _score(args)


def _fit(args) -> int:
    from llmkit.cli import UserError
    from llmkit.models import DEFAULT_MODEL, load
    from llmkit.serving.guard import Guard

    rows = read_conversations(args.data)
    labels = [bool(r.get("violation", False)) for r in rows]
    n_bad = sum(labels)
    n_ok = len(rows) - n_bad
    if n_ok < 8:
        raise UserError(f"{args.data}: {n_ok} compliant conversations; fitting needs at least 8 compliant examples")
    if args.score in ("probe", "combined") and n_bad < 2:
        raise UserError(f"{args.data}: --score {args.score} learns from violations too: it needs at least 2 lines "
                        f"with \"violation\": true beside the compliant ones (found {n_bad} violating, {n_ok} "
                        "compliant); --score energy or entropic fit on compliant lines alone")
    if args.score in ("energy", "entropic") and n_bad:
        print(f"{n_bad} lines marked \"violation\": true left out: --score {args.score} fits on compliant "
              "responses only")
    name = args.model or DEFAULT_MODEL
    model, tok = load(name)
    if args.layers and max(args.layers) > model.config.num_hidden_layers:
        raise UserError(f"--layers {max(args.layers)} is beyond this model's "
                        f"{model.config.num_hidden_layers} layers")
    try:
        guard = Guard.fit(model, tok, [r["messages"] for r in rows], model_name=name, layers=args.layers,
                          n_components=args.components, target_fpr=args.target_fpr, holdout=args.holdout,
                          seed=args.seed, batch_size=args.batch_size, progress=True, score=args.score,
                          labels=labels, window=args.window, max_length=args.max_length)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = guard.save(args.out)
    m = guard.meta
    viol = f" + {m['n_fit_violations']} violating" if m["n_fit_violations"] else ""
    print(f"{args.score} guard fitted on {m['n_fit']} compliant{viol} responses ({m['n_fit_tokens']} compliant "
          f"tokens), layers {m['layers']}, threshold {guard.threshold:.4g} at target FPR {m['target_fpr']} "
          f"(held-out FPR {m['holdout_fpr']:.3f}, n={m['n_holdout']})")
    if "holdout_auroc" in m:
        print(f"held-out AUROC {m['holdout_auroc']:.3f} ({m['n_holdout']} compliant, "
              f"{m['n_holdout_violations']} violating)")
    print(f"guard saved to {out}")
    return 0


def _score(args) -> int:
    import json
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.models import load
    from llmkit.serving.guard import Guard

    try:
        guard = Guard.load(args.guard, model_name=args.model)
    except ValueError as e:
        raise UserError(str(e)) from None
    rows = read_conversations(args.input)
    model, tok = load(args.model or guard.model_name)
    try:
        caps = guard.capture(model, tok, [r["messages"] for r in rows], batch_size=args.batch_size, progress=True)
    except ValueError as e:
        raise UserError(str(e)) from None
    scores = guard.score_captures(caps).tolist()
    out = Path(args.output) if args.output else Path(args.input).with_suffix(".guard.jsonl")
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("w", encoding="utf-8") as fh:
        for row, s in zip(rows, scores):
            fh.write(json.dumps({**row, "score": s, "flagged": s > guard.threshold}, ensure_ascii=False) + "\n")
    tmp.replace(out)
    n_flag = sum(s > guard.threshold for s in scores)
    print(f"scored {len(rows)} responses: {n_flag} flagged (threshold {guard.threshold:.4g})")
    print(f"results written to {out}")
    return 0
