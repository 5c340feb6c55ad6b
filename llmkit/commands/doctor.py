"""``llmkit doctor [--json] [--quick] [--only NAME,...] [--model M]``: environment report + smoke checks.

Prints the environment (python, torch, CUDA/ROCm, devices and memory, vllm, triton, bitsandbytes,
deepspeed, flash-attn, the sandbox), then one line per check: ``ok``, ``FAILED: <reason>`` or
``skipped: <why>``, with its time. ``--json`` prints the same as one object instead. Exit status 0
when no check failed, 1 otherwise (2 for bad arguments).
"""

from __future__ import annotations

import contextlib
import os
import sys


def register(sub):
    from llmkit.doctor.checks import CHECKS

    names = ", ".join(c.name for c in CHECKS)
    p = sub.add_parser("doctor", help="report the environment and smoke-check every path (GPU ones on a GPU)",
                       description="Environment report, then one short smoke check per path llmkit runs: "
                       f"{names}. GPU checks are skipped without a GPU. Exit 0 when nothing failed.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--quick", action="store_true",
                   help="leave out the slow checks (vLLM serving and rollouts, strategy tests, multi-GPU)")
    p.add_argument("--only", default=None, metavar="NAME,...",
                   help=f"run only these checks (comma-separated; of {names}); on a CPU-only machine this also "
                   "runs the CPU path of a GPU check that has one")
    p.add_argument("--model", default=None, help="model for the engine/recipe checks (default: the bundled "
                   "smollm2-135m-instruct on a GPU, the tiny in-process model on CPU; e.g. --model "
                   "smollm2-135m-instruct checks the bundled model on CPU too)")
    p.set_defaults(func=run)


def select_checks(only: str | None, checks):
    """The checks ``--only`` names, in the registry's order; UserError for a name that is not a check."""
    from llmkit.cli import UserError

    if only is None:
        return list(checks), frozenset()
    names = [x.strip() for x in only.split(",") if x.strip()]
    known = {c.name for c in checks}
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise UserError(f"--only {only!r}: unknown check(s) {', '.join(bad) or '(none given)'}; "
                        f"choose from {', '.join(c.name for c in checks)}")
    return [c for c in checks if c.name in names], frozenset(names)


def build_report(only: str | None = None, quick: bool = False, model: str | None = None, checks=None,
                 progress=None, env: dict | None = None) -> dict:
    """The doctor's report as a dict: ``environment``, ``checks`` (one result each), ``failed``, ``ok``, ``seconds``."""
    import tempfile
    import time
    from pathlib import Path

    from llmkit.doctor import Context, run_checks
    from llmkit.doctor.checks import CHECKS
    from llmkit.doctor.env import environment

    t0 = time.perf_counter()
    chosen, explicit = select_checks(only, CHECKS if checks is None else checks)
    env = env or environment()
    with tempfile.TemporaryDirectory(prefix="llmkit-doctor-") as tmp:
        ctx = Context(Path(tmp), model=model, quick=quick, gpus=env["gpus"], explicit=explicit)
        results = run_checks(chosen, ctx, progress=progress)
    failed = [r["name"] for r in results if r["status"] == "failed"]
    return {"environment": env, "checks": results, "failed": failed, "ok": not failed,
            "seconds": round(time.perf_counter() - t0, 2)}


def _quiet() -> None:
    """Loading bars and library chatter would bury the report's lines (and break --json on stdout)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


@contextlib.contextmanager
def _chatter_to_stderr(fd_level: bool):
    """What the checks print (trainer logs, recipe lines, library INFO) goes to stderr, so stdout holds the
    report alone. ``fd_level`` also moves writes to file descriptor 1 (C code, subprocesses inheriting it):
    ``--json`` must print one object and nothing else."""
    sys.stdout.flush()
    saved = os.dup(1) if fd_level else None
    if fd_level:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if fd_level:
            os.dup2(saved, 1)
            os.close(saved)


def run(args) -> int:
    import json

    from llmkit.doctor import result_line, summary_line
    from llmkit.doctor.checks import CHECKS
    from llmkit.doctor.env import environment, format_environment

    select_checks(args.only, CHECKS)  # a wrong name fails before anything runs
    _quiet()
    if args.json:
        with _chatter_to_stderr(fd_level=True):
            report = build_report(args.only, args.quick, args.model)
        print(json.dumps(report))
    else:
        # the environment first, then each check's line as it finishes (a GPU run takes minutes)
        env = environment()
        print("environment\n" + format_environment(env) + "\nchecks", flush=True)
        out = sys.stdout
        with _chatter_to_stderr(fd_level=False):
            report = build_report(args.only, args.quick, args.model, env=env,
                                  progress=lambda r: print(result_line(r), file=out, flush=True))
        print(summary_line(report))
    return 0 if report["ok"] else 1
