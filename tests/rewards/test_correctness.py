"""The GRPO correctness rewards score exactly like the eval tasks, in TRL's calling convention."""

from __future__ import annotations

import pytest

from llmkit.evals import get_task
from llmkit.rewards import gsm8k_correctness, math_correctness


def test_gsm8k_reward_string_and_chat_completions():
    completions = ["so 48 + 24 = 72", [{"role": "assistant", "content": "#### 71"}], "x", "#### 5"]
    answers = ["Natalia ... #### 72", "72", None, "5"]
    assert gsm8k_correctness(prompts=["p"] * 4, completions=completions, answer=answers) == [1.0, 0.0, None, 1.0]


def test_gsm8k_reward_equals_task_primary_metric(gsm8k_slice):
    t = get_task("gsm8k")
    rows = t.load(gsm8k_slice)
    outs = ["#### 72", "she earned $10.", "5 more", "624 pages, then 3"]
    expected = [t.score(o, r)[t.primary] for o, r in zip(outs, rows)]
    assert gsm8k_correctness(completions=outs, answer=[r["answer"] for r in rows]) == expected == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("completion, reward", [
    (r"so $\boxed{\frac{1}{2}}$", 1.0),
    (r"\boxed{0.5}", 1.0),
    ("0.5 (no box)", 0.0),
    ([{"role": "assistant", "content": r"\boxed{2}"}], 0.0),
])
def test_math_reward(completion, reward):
    assert math_correctness(completions=[completion], answer=[r"\frac12"]) == [reward]


def test_math_reward_gold_from_solution_or_none():
    sols = [r"hence $\boxed{3}$.", "no box here"]
    assert math_correctness(completions=[r"\boxed{3}", r"\boxed{3}"], solution=sols) == [1.0, None]
