"""``llmkit train METHOD --config X.yaml [--key value ...]``: run a training recipe."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path


def register(sub):
    from llmkit.train import METHODS

    p = sub.add_parser(
        "train", help="train with a recipe (" + ", ".join(METHODS) + ")",
        description="Run a training recipe. Options come from a YAML config (--config) and --key value "
        "overrides; `llmkit train METHOD --help` lists every key. Outputs (checkpoints, the resolved "
        "config, metrics, plots) go to the config's output_dir.",
    )
    p.add_argument("method", choices=sorted(METHODS), help="training method")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="--config FILE and --key value overrides")
    p.set_defaults(func=run)


def parse_method_args(method: str, argv: list[str]):
    from trl import TrlParser

    from llmkit.cli import UserError
    from llmkit.train import METHODS

    module = importlib.import_module(METHODS[method])
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv) and not Path(argv[i + 1]).is_file():
            raise UserError(f"config file not found: {argv[i + 1]}")
    parser = TrlParser(module.CONFIG_CLASSES, prog=f"llmkit train {method}")
    _orig_error = parser.error

    def one_line_error(message):  # keep the CLI's one-line contract
        parser.exit(2, f"llmkit train {method}: error: {message}\n")

    parser.error = one_line_error
    try:
        configs = parser.parse_args_and_config(args=argv)
    except ValueError as e:  # unknown YAML keys and bad values surface as ValueError
        raise UserError(str(e)) from None
    finally:
        parser.error = _orig_error
    return module, configs


def run(args) -> int:
    module, configs = parse_method_args(args.method, args.rest)
    return int(module.main(*configs) or 0)
