"""``llmkit doctor``: what this machine has, and one short smoke check per path llmkit runs on it.

Modelled on ``python -m bitsandbytes``, ``accelerate env``, ``vllm collect-env`` and
``torch.utils.collect_env``: an environment report (:mod:`.env`) followed by checks
(:mod:`.checks`). Each check drives the project's own code path (the hf engine, ``llmkit serve
--engine vllm``, the InQuant kernels, the Hawkeye strategy tests, ``kernels verify``, the training
recipes on their tiny configs), never a second implementation of it, and ends as

- ``ok`` (with a short detail line),
- ``failed`` (the reason: the exception's message, or what was wrong with the output), or
- ``skipped`` (why: no CUDA device, fewer than two GPUs, a package missing, no sandbox, ``--quick``).

A check needing a GPU is skipped on a CPU-only machine; the ones with a CPU path (vLLM serving,
``kernels verify``, the recipes) run that path when ``--only`` names them. Exit status 0 when no check
failed, 1 otherwise.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Check", "Context", "Skip", "format_report", "run_checks", "skip_reason"]


class Skip(Exception):
    """Raised by a check that finds, once started, that it cannot run here (the message says why)."""


@dataclass(frozen=True)
class Check:
    """One smoke check. ``fn(ctx)`` returns a detail line, raises :class:`Skip`, or raises anything else (failed)."""

    name: str
    what: str
    fn: Callable
    gpus: int = 0  # GPUs needed: 0 runs anywhere, 1 one CUDA/ROCm device, 2 more than one
    cpu_path: bool = False  # without a GPU, runs on the CPU when --only names it
    slow: bool = False  # left out by --quick unless --only names it
    packages: tuple[str, ...] = ()  # import names that must be installed


@dataclass
class Context:
    """What every check is given: the model asked for, the device it runs on, a scratch folder."""

    workdir: Path
    model: str | None = None
    quick: bool = False
    gpus: int = 0
    device: str = "cpu"
    explicit: frozenset = field(default_factory=frozenset)  # the names --only gave

    def for_device(self, device: str) -> Context:
        return Context(self.workdir, self.model, self.quick, self.gpus, device, self.explicit)


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def skip_reason(check: Check, gpus: int, explicit=frozenset(), quick: bool = False,
                installed: Callable[[str], bool] = _installed) -> str | None:
    """Why ``check`` does not run on a machine with ``gpus`` GPUs (None: it runs)."""
    if check.gpus >= 2 and gpus < 2:
        return f"needs more than one GPU (found {gpus})"
    if check.gpus == 1 and gpus == 0 and not (check.cpu_path and check.name in explicit):
        return "no CUDA device" + (f" (`--only {check.name}` runs its CPU path)" if check.cpu_path else "")
    missing = [p for p in check.packages if not installed(p)]
    if missing:
        return f"{', '.join(missing)} not installed"
    if quick and check.slow and check.name not in explicit:
        return "slow check left out by --quick"
    return None


def _release_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001, S110 - a broken CUDA runtime was already reported by the check that hit it
        pass


def _reason(e: BaseException) -> str:
    lines = [m.strip() for m in str(e).strip().splitlines() if m.strip()]
    if isinstance(e, AssertionError):  # the checks' own messages say it in their first line
        return lines[0] if lines else "assertion failed"
    # library errors: the first line names the error, the last often the cause (a subprocess's tail)
    text = " | ".join(lines[:1] + lines[-1:]) if len(lines) > 1 else "".join(lines)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def run_checks(checks, ctx: Context, progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Run ``checks`` in order; one ``{"name", "status", "reason", "detail", "seconds"}`` per check.

    ``status`` is ``ok``, ``failed`` or ``skipped``; ``reason`` says why for the last two. A failing
    check never stops the others.
    """
    results = []
    for check in checks:
        t0 = time.perf_counter()
        why = skip_reason(check, ctx.gpus, ctx.explicit, ctx.quick)
        res = {"name": check.name, "status": "skipped", "reason": why, "detail": None, "seconds": 0.0}
        if why is None:
            device = "cuda" if check.gpus and ctx.gpus else "cpu"
            try:
                res["detail"] = check.fn(ctx.for_device(device))
                res["status"] = "ok"
            except Skip as e:
                res["reason"] = str(e)
            except Exception as e:  # noqa: BLE001 - any error of a check is its verdict, not the doctor's crash
                res["status"], res["reason"] = "failed", _reason(e)
            res["seconds"] = round(time.perf_counter() - t0, 2)
            _release_memory()
        results.append(res)
        if progress:
            progress(res)
    return results


def result_line(res: dict, width: int = 20) -> str:
    status = {"ok": "ok", "failed": f"FAILED: {res['reason']}", "skipped": f"skipped: {res['reason']}"}[res["status"]]
    tail = f"  -- {res['detail']}" if res["status"] == "ok" and res.get("detail") else ""
    return f"  {res['name']:<{width}} {status}  ({res['seconds']:.1f} s){tail}"


def format_report(report: dict) -> str:
    """The text form of a doctor report (environment, then one line per check, then a summary)."""
    from llmkit.doctor.env import format_environment

    lines = ["environment", format_environment(report["environment"]), "checks"]
    lines += [result_line(r) for r in report["checks"]]
    lines.append(summary_line(report))
    return "\n".join(lines)


def summary_line(report: dict) -> str:
    counts = {s: sum(r["status"] == s for r in report["checks"]) for s in ("ok", "failed", "skipped")}
    return (f"{counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped "
            f"in {report['seconds']:.1f} s" + (f" (failed: {', '.join(report['failed'])})" if report["failed"] else ""))
