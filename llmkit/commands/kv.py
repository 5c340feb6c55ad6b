"""``llmkit kv``: KV-cache tools. ``calibrate`` makes the InQuant calibration that ``llmkit serve
--kv-cache inquant`` uses.

    llmkit kv calibrate                                   # bundled model, 16 GSM8K train texts
    llmkit kv calibrate --model ./my-model --data notes.txt --texts 32
    llmkit kv calibrate --model org/model --out calib.safetensors
    llmkit kv show --model ./my-model                     # what serve would use

One forward pass of the model over a few texts gives each layer's channel saliency, channel means,
query second moments and output-projection weights (``llmkit.serving.kv_cache.calibrate``); they are
saved as safetensors together with the cache settings (layout, gate, outlier slots). By default the
file goes where ``llmkit serve`` looks for it: ``<model folder>/kv_cache/inquant_calibration.safetensors``
for a local folder (the bundled model included), ``$LLMKIT_HOME/kv_calibration/<id>.safetensors`` for a hub id.
"""

from __future__ import annotations

from llmkit.cli_types import positive_int

DEFAULT_DATA = "openai/gsm8k"  # train split, config main


def register(sub):
    p = sub.add_parser("kv", help="KV-cache tools: calibrate InQuant for a model (used by serve --kv-cache inquant)",
                       description="KV-cache tools for the hf engine's quantized caches.")
    ss = p.add_subparsers(dest="kv_command", metavar="ACTION")
    c = ss.add_parser(
        "calibrate", help="calibrate InQuant's channel saliency and score gate on text and save it for serving",
        description="Run the model once over a few texts and save InQuant's calibration (channel saliency, "
        "channel means, attention-score weights) with the cache settings. `llmkit serve --kv-cache inquant` "
        "then uses it: calibrated per-token groups with the attention-score gate, continuously batched. "
        "Without a calibration serve falls back to the uncalibrated per-channel cache (static batching).")
    c.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    c.add_argument("--data", default=DEFAULT_DATA,
                   help=".jsonl with 'text' (or question/answer, problem/solution, prompt/completion) fields, a "
                   f"plain text file, or a hub dataset id (its train split; default: {DEFAULT_DATA})")
    c.add_argument("--start", type=int, default=100,
                   help="skip this many lines of a .jsonl file first (default 100: GSM8K train rows 0-99 are "
                   "left for few-shot exemplars)")
    c.add_argument("--texts", type=positive_int, default=16, help="calibration texts (default 16)")
    c.add_argument("--max-len", type=positive_int, default=512, help="tokens per calibration text (default 512)")
    c.add_argument("--layout", choices=("per-token", "per-channel"), default="per-token",
                   help="key/value grouping saved for serving (default per-token: no full-precision window, "
                   "continuous batching)")
    c.add_argument("--gate", choices=("score", "ratio", "off"), default="score",
                   help="which (outlier, donor) pairs are kept: score = per head, where attention-score error "
                   "drops (default); ratio = range ratio; off = every candidate pair")
    c.add_argument("--n-outliers", type=positive_int, default=4, help="outlier slots per kv-head and side (default 4)")
    c.add_argument("--group-size", type=positive_int, default=128, help="tokens per group, per-channel layout (default 128)")
    c.add_argument("--out", default=None, metavar="FILE",
                   help="where to save (default: the path serve looks up for this model)")
    c.add_argument("--dtype", default="float32", help="model dtype for the pass (default float32)")
    c.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from its folder/hub")
    c.set_defaults(func=run)
    s = ss.add_parser("show", help="say which InQuant cache serve would build for a model, and from which file",
                      description="Print the calibration serve would use for a model (or a given file) and "
                      "how many outlier pairs its descriptors keep.")
    s.add_argument("--model", default=None, help="alias, local folder or HF id (default: smollm2-135m-instruct)")
    s.add_argument("--calibration", default=None, metavar="FILE", help="a calibration file (default: the model's)")
    s.set_defaults(func=run)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run(args) -> int:
    return _calibrate(args) if args.kv_command == "calibrate" else _show(args)


def _calibrate(args) -> int:
    import tempfile
    import time
    from pathlib import Path

    from llmkit.cli import UserError

    if args.start < 0:
        raise UserError(f"--start {args.start}: must be >= 0")
    from llmkit.evals.data import is_hub_id

    if not is_hub_id(args.data) and not Path(args.data).is_file():
        raise UserError(f"--data {args.data}: no such file (nor a hub dataset id 'owner/name')")
    from llmkit.models import load
    from llmkit.serving.kv_cache import calibrate, default_calibration_path, read_calibration_texts

    model, tok = load(args.model, dtype=args.dtype, **({"trust_remote_code": True} if args.trust_remote_code else {}))
    model.eval()
    try:
        with tempfile.TemporaryDirectory(prefix="llmkit-kv-") as tmp:
            texts = read_calibration_texts(_local_data(args.data, tmp), tok, args.texts, args.max_len,
                                           start=args.start)
    except ValueError as e:
        raise UserError(f"--data {args.data}: {e}") from None
    t0 = time.perf_counter()
    cal = calibrate(model, texts, tok, max_len=args.max_len, sample_tokens=args.max_len)
    cal.meta["cache"] = {"layout": args.layout, "gate": args.gate, "n_outliers": args.n_outliers,
                         "group_size": args.group_size}
    cal.meta["data"] = str(args.data)
    out = cal.save(args.out or default_calibration_path(model))
    print(f"llmkit kv calibrate: {cal.meta['texts']} texts, {cal.meta['tokens']} tokens of {args.data} in "
          f"{time.perf_counter() - t0:.1f} s; {_pairs_line(cal)}")
    print(f"saved {out}" + ("" if args.out else " (llmkit serve --kv-cache inquant uses it for this model)"))
    return 0


def _local_data(data: str, tmp: str) -> str:
    """``data`` itself when it is a local file; a hub id's train rows written to a .jsonl in ``tmp`` (the text
    reader works on files, and its ``--start`` counts lines)."""
    import json
    from pathlib import Path

    from llmkit.evals.data import is_hub_id, load_hub

    if not is_hub_id(data):
        return data
    rows = load_hub(data, "main" if data == DEFAULT_DATA else None, "train")
    out = Path(tmp) / "calibration.jsonl"
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_source"}) + "\n" for r in rows))
    return str(out)


def _pairs_line(cal) -> str:
    st = cal.cache_settings
    used = possible = 0
    for i in range(cal.num_layers):
        for which in ("k", "v"):
            d = cal.descriptor(i, which, st["n_outliers"], 8, st["gate"], st["layout"], st["group_size"])
            used += int(d.pairs_per_head.sum())
            possible += st["n_outliers"] * d.outliers.shape[0]
    return (f"{st['layout']} groups, {st['gate']} gate: {used} of {possible} (outlier, donor) pairs kept "
            "over layers, kv-heads, keys and values")


def _show(args) -> int:
    from llmkit.cli import UserError
    from llmkit.models import load
    from llmkit.serving.kv_cache import _load_calibration, default_calibration_path, inquant_serving_factory

    model, _ = load(args.model)
    try:
        _, msg = inquant_serving_factory(model, args.calibration)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(msg)
    path = args.calibration or default_calibration_path(model)
    from pathlib import Path

    if Path(path).is_file():
        print(_pairs_line(_load_calibration(str(path))))
    return 0
