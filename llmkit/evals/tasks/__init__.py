"""Eval tasks by name: ``get_task("gsm8k" | "math500" | "iheval" | "iheval:<category>/<task>")``."""

from __future__ import annotations

from llmkit.evals.tasks.base import Task

TASKS = ("gsm8k", "math500", "iheval")


def get_task(name: str) -> Task:
    key = name.strip().lower()
    if key == "gsm8k":
        from llmkit.evals.tasks.gsm8k import GSM8K

        return GSM8K()
    if key in ("math500", "math", "math-500"):
        from llmkit.evals.tasks.math500 import MATH500

        return MATH500()
    if key == "iheval" or key.startswith("iheval:"):
        from llmkit.evals.iheval import IHEvalTask

        return IHEvalTask(key.partition(":")[2] or None)
    from llmkit.cli import UserError

    raise UserError(f"unknown eval task '{name}': choose from {', '.join(TASKS)} or iheval:<category>/<task>")


__all__ = ["TASKS", "Task", "get_task"]
