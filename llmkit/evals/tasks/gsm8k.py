"""GSM8K, extracted and graded the way lm-eval-harness's ``gsm8k`` task grades.

Gold: the number after ``####`` in ``answer``. A model output is scored three ways:

- ``strict_match``: lm-eval's "strict-match" filter, the first ``#### <number>``;
- ``flexible_extract``: lm-eval's "flexible-extract" filter, the last number-like span;
- ``math_verify``: math-verify's parse of the whole output against the gold number.

The two lm-eval numbers then go through lm-eval's ``exact_match`` with the
task's settings (drop ``,``, ``$``, everything up to ``#### ``, a trailing
``.``; ignore case). The patterns below are the ones in lm-eval's
``tasks/gsm8k/gsm8k.yaml`` (0.4.13); a test checks equality with lm-eval's own
filter and metric code on the same outputs. ``flexible_extract`` is the
primary metric (the reported ``accuracy`` and the GRPO reward): a chat model
asked zero-shot rarely writes ``####`` unprompted, and lm-eval's flexible
filter is the usual headline for chat models.
"""

from __future__ import annotations

import re

from llmkit.evals.mathverify import verify_answer
from llmkit.evals.tasks.base import Task

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
IGNORE = (r",", r"\$", r"(?s).*#### ", r"\.$")
INVALID = "[invalid]"

INSTRUCTION = ("Solve the problem step by step. End your response with the final answer on its own line "
               "in the form '#### <number>'.")


def strict_extract(text: str) -> str:
    m = STRICT.findall(text)
    return m[0].strip() if m else INVALID


def flexible_extract(text: str) -> str:
    m = FLEXIBLE.findall(text)
    if not m:
        return INVALID
    groups = [g for g in m[-1] if g]
    return groups[0].strip() if groups else INVALID


def normalize(s: str) -> str:
    for pat in IGNORE:
        s = re.sub(pat, "", s)
    return s.lower()


def gold_answer(answer: str) -> str:
    """The number after '####' (or the whole string when it is already a bare answer)."""
    return answer.split("####")[-1].strip()


class GSM8K(Task):
    name = "gsm8k"
    primary = "flexible_extract"
    metrics = ("strict_match", "flexible_extract", "math_verify")
    hub_id = "openai/gsm8k"
    hub_config = "main"
    required = ("question", "answer")
    max_new_tokens = 512

    def user_message(self, sample):
        return f"{sample['question']}\n\n{INSTRUCTION}"

    def assistant_message(self, sample):
        return sample["answer"]

    def gold(self, sample):
        return gold_answer(sample["answer"])

    def extract(self, output):
        return {"strict_match": strict_extract(output), "flexible_extract": flexible_extract(output)}

    def score(self, output, sample):
        gold = normalize(sample["answer"])
        ex = self.extract(output)
        return {
            "strict_match": float(normalize(ex["strict_match"]) == gold),
            "flexible_extract": float(normalize(ex["flexible_extract"]) == gold),
            "math_verify": float(self.math_verify(output, sample)),
        }

    def math_verify(self, output: str, sample) -> bool:
        """math-verify on the answer the output declares: the number after its first ``####`` when there is
        one (the format the prompt asks for), else the whole output. Parsing the whole text of a worked
        solution picks up intermediate results (``33.333...%`` before ``#### 33``, calculator annotations
        ``<<26+15=41>>``), which marked 4 of the 1319 gold solutions wrong."""
        declared = strict_extract(output)
        if declared != INVALID:
            return verify_answer(self.gold(sample), declared.replace(",", "").rstrip("."), prediction_is_answer=True)
        return verify_answer(self.gold(sample), re.sub(r"<<[^>]*>>", "", output))
