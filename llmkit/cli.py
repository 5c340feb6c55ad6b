"""The ``llmkit`` command.

Each subcommand lives in ``llmkit/commands/<name>.py`` with two functions:
``register(subparsers)`` adds its parser (and ``set_defaults(func=run)``), and
``run(args) -> int`` does the work. Heavy imports stay inside ``run`` so that
``llmkit --help`` answers at once.

Errors a user can cause end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under llmkit.commands; order is the order in --help
COMMANDS = [
    "models",
    "chat",
    "train",
    "eval",
    "serve",
    "kv",
    "guard",
    "ldp-proxy",
    "steer",
    "merge",
    "tools",
    "kernels",
    "select",
    "tune",
    "doctor",
]


class UserError(Exception):
    """A mistake in the user's input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmkit",
        description="LLM post-training and serving toolkit: train recipes on TRL, serve an "
        "OpenAI-compatible API, evaluate on GSM8K / MATH-500 / IHEval. "
        "The default model everywhere is the bundled smollm2-135m-instruct.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        module = importlib.import_module(f"llmkit.commands.{name.replace('-', '_')}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2 if args.command is None and argv else 0
    from llmkit.models import ModelNotFoundError

    try:
        return int(args.func(args) or 0)
    except (UserError, ModelNotFoundError, FileNotFoundError) as e:
        msg = str(e) if not isinstance(e, FileNotFoundError) or not e.filename else f"no such file: {e.filename}"
        print(f"llmkit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run through the imported module: as __main__ this file's UserError would be a different
    # class from the llmkit.cli.UserError that commands raise, and errors would print tracebacks.
    from llmkit.cli import main as _main

    sys.exit(_main())
