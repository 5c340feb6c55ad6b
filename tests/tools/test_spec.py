"""ToolSpec: JSON Schema validation against the function's real signature; call validation; ToolPool."""

from __future__ import annotations

import pytest

from llmkit.tools import ToolPool, ToolSpec
from llmkit.tools.spec import value_matches

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}


def spec(code, params=OBJ, name="f", returns="integer"):
    return ToolSpec(name=name, parameters=params, code=code, returns=returns)


def test_matching_schema_has_no_errors():
    assert spec("def f(a: int, b: str) -> int:\n    return a\n").schema_errors() == []
    opt = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    assert spec("def f(a, b='x'):\n    return a\n", opt).schema_errors() == []


@pytest.mark.parametrize("code,params,name,returns,fragment", [
    ("def f(a, c):\n    return a\n", OBJ, "f", "integer", "differ from schema properties"),
    ("def g(a, b):\n    return a\n", OBJ, "f", "integer", "does not define a function named 'f'"),
    ("def f(a, b):\n  return (\n", OBJ, "f", "integer", "does not parse"),
    ("def f(*args):\n    return 1\n", OBJ, "f", "integer", "*args"),
    ("def f(a: str, b: str):\n    return a\n", OBJ, "f", "integer", "annotated str but the schema says integer"),
    ("def f(a, b):\n    return a\n", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                     "b": {"type": "string"}}, "required": ["a"]},
     "f", "integer", "without defaults must be required"),
    ("def f(a, b):\n    return a\n", {"type": "objekt", "properties": {}}, "f", "integer", "not a valid JSON Schema"),
    ("def f(a, b):\n    return a\n", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                     "b": {"type": "strin"}}}, "f", "integer",
     "unknown type"),
    ("def f(a, b):\n    return a\n", ["a", "b"], "f", "integer", "must be a JSON object"),
    ("def f(a, b):\n    return a\n", OBJ, "f", "int", "returns must be one of"),
    ("def f(a, b):\n    return a\n", OBJ, "bad name", "integer", "not a Python identifier"),
])
def test_schema_errors_are_caught(code, params, name, returns, fragment):
    errs = spec(code, params, name, returns).schema_errors()
    assert any(fragment in e for e in errs), errs


def test_call_validation_and_return_types():
    s = spec("def f(a, b):\n    return a\n")
    assert s.call_errors({"a": 1, "b": "x"}) == []
    assert s.call_errors({"a": "1", "b": "x"}) and s.call_errors({"a": 1}) and s.call_errors([1, "x"])
    assert value_matches(3, "integer") and not value_matches(3.5, "integer") and not value_matches("3", "integer")
    assert value_matches([1], "array") and value_matches(True, "boolean") and value_matches(None, None)
    assert s.to_openai()["function"]["parameters"] == OBJ
    assert ToolSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize("where", ["pool", "pool.sqlite"])
def test_pool_keeps_provenance_and_best(tmp_path, where):
    pool = ToolPool(tmp_path / where)
    a = spec("def f(a, b):\n    return a\n")
    b = spec("def f(a, b):\n    return a + 0\n")
    pool.add(a, "gcd", 0.5, step=3, source="policy")
    pool.add(b, "gcd", 1.0, step=7, source="policy")
    pool.add(a, "lcm", 1.0, step=1, source="smollm2")
    pool.add(a, "gcd", 0.25, step=9)  # same tool, lower score: ignored
    again = ToolPool(tmp_path / where)  # reload from disk
    assert len(again) == 3 and again.families() == ["gcd", "lcm"]
    best = again.best("gcd")
    assert best.spec == b and best.score == 1.0 and best.step == 7 and best.source == "policy"
    assert [e.score for e in again.entries("gcd")] == [1.0, 0.5]
    assert again.best("count_primes") is None
    assert again.growth() == [(1, 1), (3, 2), (7, 3)]
