"""``llmkit train METHOD --config X.yaml [--key value ...]``: run a training recipe."""

from __future__ import annotations

import argparse
import importlib


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
    """(the method's recipe module, its parsed config dataclasses); see ``llmkit.train.skeleton.parse_args``."""
    from llmkit.train import METHODS
    from llmkit.train.skeleton import parse_args

    module = importlib.import_module(METHODS[method])
    return module, parse_args(module.CONFIG_CLASSES, argv, prog=f"llmkit train {method}")


def run(args) -> int:
    module, configs = parse_method_args(args.method, args.rest)
    return int(module.main(*configs) or 0)
