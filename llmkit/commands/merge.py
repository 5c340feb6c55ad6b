"""``llmkit merge ADAPTER --out DIR``: fold a LoRA adapter into its base model's weights."""

from __future__ import annotations


def register(sub):
    p = sub.add_parser(
        "merge", help="merge a PEFT/LoRA adapter into its base model",
        description="Load the base model named in ADAPTER/adapter_config.json (an alias, a folder or a hub "
        "id), apply the adapter, merge it into the weights and save a plain checkpoint that any tool "
        "loads (transformers, vLLM, llmkit eval/serve/chat). llmkit eval/serve/chat also accept the "
        "adapter folder directly (merged once into $LLMKIT_HOME/merged).",
    )
    p.add_argument("adapter", help="adapter folder (holds adapter_config.json), e.g. a LoRA run's output_dir")
    p.add_argument("--out", required=True, help="folder for the merged checkpoint")
    p.add_argument("--dtype", default="float32", help="dtype of the saved weights (float32, bf16, fp16)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from llmkit.cli import UserError
    from llmkit.models import is_adapter_folder, merge_adapter, parse_dtype

    adapter = Path(args.adapter).expanduser()
    if not adapter.is_dir():
        raise UserError(f"adapter folder not found: {adapter}")
    if not is_adapter_folder(adapter):
        raise UserError(f"'{adapter}' is not a PEFT adapter folder (no adapter_config.json)")
    try:
        parse_dtype(args.dtype)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = merge_adapter(adapter, args.out, dtype=args.dtype)
    print(f"merged {adapter} into {out}")
    return 0
