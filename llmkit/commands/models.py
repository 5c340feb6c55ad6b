"""``llmkit models``: list the built-in model aliases."""

from __future__ import annotations


def register(sub):
    p = sub.add_parser("models", help="list built-in model aliases", description="List built-in model aliases "
                       "and whether each is converted in the cache ($LLMKIT_HOME, default ~/.cache/llmkit).")
    p.set_defaults(func=run)


def run(args) -> int:
    from llmkit.models import DEFAULT_MODEL, _is_complete, alias_dir, list_aliases

    for a in list_aliases():
        state = "cached" if _is_complete(alias_dir(a.name)) else "converted on first use"
        default = " (default)" if a.name == DEFAULT_MODEL else ""
        print(f"{a.name}{default}\t{a.description}\t[{state}: {alias_dir(a.name)}]")
    return 0
