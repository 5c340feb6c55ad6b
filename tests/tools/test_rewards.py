"""The three reward axes on hand-written build and use completions; rollout parsing."""

from __future__ import annotations

import json

import pytest

from llmkit.rewards.tools import SmithRewards, combined_reward
from llmkit.tools import sandbox, tasks
from llmkit.tools.rollouts import parse_build, parse_use, reference_build_trace, reference_use_trace

pytestmark = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")

FAM = tasks.get("gcd")
GOOD = reference_build_trace(FAM)
SCHEMA_ERROR = GOOD.replace('"type": "object"', '"type": "objekt"')
WRONG_NAMES = GOOD.replace('"numbers"', '"nums"')  # schema no longer matches the signature
CRASH = GOOD.replace("g = 0", "g = 1 / 0")
WRONG = GOOD.replace("return g", "return g + 1")
WRONG_TYPE = GOOD.replace("return g", "return str(g)")


def _build(texts, fam="gcd"):
    r = SmithRewards(checks=4)
    kw = {"kind": ["build"] * len(texts), "family": [fam] * len(texts), "seed": [0] * len(texts)}
    return [f(completions=texts, **kw) for f in r.funcs]


def test_build_axes_separate_failure_modes():
    (s, c, o) = _build([GOOD, SCHEMA_ERROR, WRONG_NAMES, CRASH, WRONG, WRONG_TYPE, "I cannot do that."])
    assert (s[0], c[0], o[0]) == (1.0, 1.0, 1.0)
    # a schema error lowers only the schema axis
    assert s[1] < 1.0 and (c[1], o[1]) == (1.0, 1.0)
    assert s[2] < 1.0 and s[2] > 0  # valid JSON Schema that does not match the function
    # a crashing tool lowers the code axis and with it the outcome, not the schema
    assert s[3] == 1.0 and c[3] == 0.0 and o[3] == 0.0
    # a tool that runs but answers wrong lowers only the outcome
    assert s[4] == 1.0 and c[4] == 1.0 and o[4] == 0.0
    # returning another type than declared is a code failure
    assert c[5] == 0.0
    assert (s[6], c[6], o[6]) == (0.0, 0.0, 0.0)


def _use_kw(n, inst, tool):
    return {"kind": ["use"] * n, "family": ["gcd"] * n, "seed": [0] * n,
            "instance": [json.dumps({"question": inst.question, "args": inst.args, "answer": inst.answer})] * n,
            "tool": [json.dumps(tool.to_dict())] * n}


def test_use_axes():
    inst = FAM.generate(1, seed=5)[0]
    tool = FAM.reference
    good = reference_use_trace(inst, tool)
    bad_args = f'<tool_call>{{"name": "{tool.name}", "arguments": {{"numbers": "12, 18"}}}}</tool_call>\nAnswer: 6'
    wrong_name = good.replace(tool.name, "gcd_tool")
    no_call = f"The answer is easy.\nAnswer: {inst.answer}"
    no_call_wrong = "Answer: 123456789"
    texts = [good, bad_args, wrong_name, no_call, no_call_wrong]
    r = SmithRewards()
    s, c, o = [f(completions=texts, **_use_kw(len(texts), inst, tool)) for f in r.funcs]
    assert (s[0], c[0], o[0]) == (1.0, 1.0, 1.0)
    assert s[1] == 0.0 and c[1] == 0.0  # the string crashes the tool (schema said array of integers)
    assert s[2] == 0.0 and c[2] == 1.0 and o[2] == 1.0  # wrong name: schema axis only; the pooled tool ran
    assert s[3] == 0.0 and c[3] is None and o[3] == 1.0  # no call: code axis does not apply
    assert c[4] is None and o[4] == 0.0


def test_rows_of_other_kinds_get_none_and_combined_sums():
    texts = [GOOD, "x"]
    kw = {"kind": ["build", "plain"], "family": ["gcd", "gcd"], "seed": [0, 0]}
    assert combined_reward(completions=texts, **kw) == [3.0, None]
    r = SmithRewards()
    assert r.schema_reward(completions=texts, **kw)[1] is None


def test_passing_builds_are_reported_once_with_the_step():
    seen = []
    r = SmithRewards(on_pass=lambda spec, fam, score, step: seen.append((spec.name, fam, score, step)))

    class State:
        global_step = 4

    kw = {"kind": ["build"] * 3, "family": ["gcd"] * 3, "seed": [0] * 3, "trainer_state": State()}
    for f in r.funcs:
        f(completions=[GOOD, WRONG, GOOD], **kw)
    assert seen == [("gcd_of", "gcd", 1.0, 4)]


def test_parsers():
    spec, code = parse_build("Here:\n```json\n{\"name\": \"f\"}\n```\n```python\ndef f(x):\n    return x\n```")
    assert spec == {"name": "f"} and code.startswith("def f(x)")
    spec, code = parse_build('{"name": "g", "parameters": {}}\ndef g():\n    return 1\n')
    assert spec["name"] == "g" and code.startswith("def g()")
    assert parse_build("no tool here") == (None, None)
    call, ans = parse_use('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nAnswer: 3')
    assert call == {"name": "f", "arguments": {"x": 1}} and ans == "3"
    call, ans = parse_use("I think it is\n42")
    assert call is None and ans == "42"


def test_parse_use_reads_what_a_small_model_writes_but_not_an_echoed_schema():
    call = {"name": "f", "arguments": {"x": 1}}
    # a call in a ```json fence without the tag, and one with arguments as a JSON string (OpenAI style)
    assert parse_use(f"```json\n{json.dumps(call)}\n```\nAnswer: 2")[0] == call
    assert parse_use('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[0] == call
    # Llama style: "parameters" holding the argument values is a call
    assert parse_use('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')[0] == call
    # the tool's schema echoed back ("parameters" is a JSON Schema) is not a call, even before a real call
    schema = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    assert parse_use(json.dumps(schema, indent=1) + "\nAnswer: 5") == (None, "5")
    assert parse_use(json.dumps(schema) + f"\n<tool_call>{json.dumps(call)}</tool_call>")[0] == call
    # garbage and bare argument objects are not calls
    assert parse_use('<tool_call>{"x": 1}</tool_call>')[0] is None
    assert parse_use("<tool_call>f(x=1)</tool_call>")[0] is None


def test_use_reply_in_a_fence_scores_like_the_tagged_one():
    inst = FAM.generate(1, seed=3)[0]
    tagged = reference_use_trace(inst, FAM.reference)
    fenced = tagged.replace("<tool_call>", "```json\n").replace("</tool_call>", "\n```")
    r = SmithRewards(checks=2)
    kw = {"kind": ["use"] * 2, "family": ["gcd"] * 2, "seed": [0, 0],
          "instance": [json.dumps({"question": inst.question, "args": inst.args, "answer": inst.answer})] * 2,
          "tool": [json.dumps(FAM.reference.to_dict())] * 2}
    assert [f(completions=[tagged, fenced], **kw) for f in r.funcs] == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
