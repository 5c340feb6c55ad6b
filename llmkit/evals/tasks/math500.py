"""MATH (MATH-500 and the original 5000-problem test set): last ``\\boxed{}`` + math-verify.

Accepted records: MATH-500 (``problem``, ``solution``, ``answer``, ...) and the
original MATH format (``problem``, ``solution`` with the answer in its last
``\\boxed{}``, ``level``, ``type``). The gold answer is ``answer`` when present,
else the last boxed expression of ``solution``.

A model output is scored by its last ``\\boxed{...}`` (no box: wrong), compared
with the gold by math-verify (sympy equivalence, sets/intervals/matrices,
units and ``\\text`` stripped). The prompt asks for the box, as the common
zero-shot MATH prompts of instruct models do.
"""

from __future__ import annotations

from llmkit.evals.data import DataError
from llmkit.evals.mathverify import last_boxed, verify_answer
from llmkit.evals.tasks.base import Task

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def minerva_exemplars() -> list[dict]:
    """lm-eval's 4-shot Minerva MATH exemplars, read from the installed package's source.

    Importing ``lm_eval.tasks.minerva_math.utils`` demands antlr4 4.11 (it clashes
    with math-verify's), so the literal list is read with ``ast`` instead.
    """
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("lm_eval")
    src = Path(spec.origin).parent / "tasks" / "minerva_math" / "utils.py"
    tree = ast.parse(src.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "list_fewshot_samples":
            ret = next(n for n in node.body if isinstance(n, ast.Return))
            return [{"problem": s["problem"], "solution": s["solution"]} for s in ast.literal_eval(ret.value)]
    raise DataError(f"{src}: no list_fewshot_samples() found for MATH few-shot prompts")


def gold_answer(sample: dict) -> str | None:
    ans = sample.get("answer")
    if ans not in (None, ""):
        return str(ans)
    return last_boxed(sample.get("solution") or "")


class MATH500(Task):
    name = "math500"
    primary = "math_verify"
    metrics = ("math_verify", "boxed")
    hub_id = "HuggingFaceH4/MATH-500"
    hub_config = None
    required = ("problem",)
    max_new_tokens = 1024

    def validate(self, rec):
        super().validate(rec)
        if gold_answer(rec) is None:
            raise DataError(f"{rec.get('_source', '<record>')}: missing field 'answer' "
                            "(and no \\boxed{} answer in 'solution')")

    def fewshot_pool(self):
        """A ``train`` file next to the local data if there is one, else lm-eval's four Minerva exemplars."""
        if self._fewshot is None:
            try:
                return super().fewshot_pool()
            except DataError:
                if self._data is None:
                    raise
            self._fewshot = minerva_exemplars()
        return self._fewshot

    def user_message(self, sample):
        return f"{sample['problem']}\n\n{INSTRUCTION}"

    def assistant_message(self, sample):
        sol = sample.get("solution") or ""
        gold = gold_answer(sample)
        # a solution without a box (rare in MATH) gets the gold answer boxed at its end
        return sol if last_boxed(sol) is not None else f"{sol}\n\nThe final answer is $\\boxed{{{gold}}}$."

    def gold(self, sample):
        return gold_answer(sample)

    def extract(self, output):
        return {"boxed": last_boxed(output)}

    def score(self, output, sample):
        pred = last_boxed(output)
        return {"math_verify": float(verify_answer(self.gold(sample), pred, prediction_is_answer=True)),
                "boxed": float(pred is not None)}
