"""Evals: GSM8K, MATH-500 and IHEval, graded the way the reference harnesses grade.

    from llmkit.evals import run_eval, get_task
    summary = run_eval("gsm8k", engine, limit=20)  # hub openai/gsm8k; data="my/test.jsonl" for a local file
    summary["accuracy"], summary["metrics"]

``run_eval(task, engine=None, *, data=None, limit=None, num_fewshot=0, max_new_tokens=None,
temperature=0.0, top_p=1.0, n=1, seed=0, score_gold=False, output_dir=None, model=None,
engine_name="hf", progress=True) -> dict`` (see ``llmkit.evals.harness``). Tasks:
``llmkit.evals.tasks.get_task(name)``; IHEval: ``llmkit.evals.iheval``.
"""

from llmkit.evals.harness import pass_at_k, run_eval, write_report
from llmkit.evals.tasks import TASKS, Task, get_task

__all__ = ["TASKS", "Task", "get_task", "pass_at_k", "run_eval", "write_report"]
