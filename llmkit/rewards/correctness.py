"""Answer-correctness rewards for GRPO, scored by the same code as the evals.

TRL calls a reward function as ``f(prompts=, completions=, completion_ids=,
**dataset_columns)``; each returns one float per completion, or None where
the row has no gold answer (TRL then ignores this reward for that row).
Completions are strings, or lists of chat messages (conversational datasets).

- ``gsm8k_correctness``: the GSM8K eval's primary metric (lm-eval's
  flexible-extract + exact match) against the gold in ``answer`` (the text
  after ``####``, or a bare number).
- ``math_correctness``: the MATH eval's metric (last ``\\boxed{}`` +
  math-verify) against ``answer``, or the last ``\\boxed{}`` of ``solution``.
"""

from __future__ import annotations

from functools import cache


def completion_text(completion) -> str:
    """The generated text of one TRL completion (a string or a list of chat messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion
                       if not isinstance(m, dict) or m.get("role", "assistant") == "assistant")
    return str(completion)


@cache
def _task(name: str):
    from llmkit.evals.tasks import get_task

    return get_task(name)


def _column(values, i):
    if values is None:
        return None
    if isinstance(values, str):  # one gold for the whole batch
        return values
    return values[i] if i < len(values) else None


def gsm8k_correctness(prompts=None, completions=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 if the completion's answer equals the GSM8K gold (lm-eval flexible-extract), else 0.0."""
    task = _task("gsm8k")
    out: list[float | None] = []
    for i, c in enumerate(completions or []):
        gold = _column(answer, i)
        if gold in (None, ""):
            out.append(None)
            continue
        out.append(task.score(completion_text(c), {"answer": str(gold)})[task.primary])
    return out


def math_correctness(prompts=None, completions=None, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 if the completion's last ``\\boxed{}`` is math-verify-equivalent to the gold, else 0.0."""
    from llmkit.evals.tasks.math500 import gold_answer

    task = _task("math500")
    out: list[float | None] = []
    for i, c in enumerate(completions or []):
        sample = {"answer": _column(answer, i), "solution": _column(solution, i)}
        if gold_answer(sample) is None:
            out.append(None)
            continue
        out.append(task.score(completion_text(c), sample)[task.primary])
    return out
