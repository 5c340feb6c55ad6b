"""build_tools / evaluate with scripted writers and users; `llmkit tools build|eval` input errors."""

from __future__ import annotations

import json

import pytest

from llmkit.tools import ToolPool, sandbox, tasks
from llmkit.tools.rollouts import reference_build_trace

pytestmark = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")
FAMS = ("count_primes", "ransom_note")


def scripted_writer(convs):
    """Writes the reference tool of whichever family the build prompt's hint names."""
    out = []
    for c in convs:
        text = c[-1]["content"]
        fam = next(f for f in tasks.FAMILIES.values() if f.hint in text)
        out.append(reference_build_trace(fam) if fam.name == "count_primes" else "no idea")
    return out


def scripted_user(convs):
    """Copies the arguments out of the question into a call when a tool is offered; guesses 'True' otherwise."""
    out = []
    for c in convs:
        text = c[-1]["content"]
        if "You can call this tool" in text:
            name = json.loads(text.split("You can call this tool:\n")[1].split("\n\nReply")[0])["name"]
            fam = "count_primes" if name == "count_primes_between" else "ransom_note"
            inst = next(i for i in tasks.get(fam).generate(3, seed=tasks.EVAL_SEED_OFFSET)
                        if i.question.strip() in text)
            out.append(f'<tool_call>{json.dumps({"name": name, "arguments": inst.args})}</tool_call>')
        else:
            out.append("Answer: True")
    return out


def test_build_then_eval_uses_only_verified_tools(tmp_path):
    from llmkit.tools.evaluate import build_tools, evaluate

    pool = ToolPool(tmp_path / "pool")
    rep = build_tools(scripted_writer, FAMS, pool, examples=2, checks=3, source="script", progress=False)
    assert rep["count_primes"]["added"] and not rep["ransom_note"]["added"]
    assert pool.families() == ["count_primes"] and pool.best("count_primes").source == "script"
    r = evaluate(scripted_user, FAMS, pool=pool, n=3, progress=False)
    assert r["used_tool"] == {"count_primes": True, "ransom_note": False}
    assert r["per_family"]["count_primes"] == 1.0
    truth = [i.answer == "True" for i in tasks.get("ransom_note").generate(3, seed=tasks.EVAL_SEED_OFFSET)]
    assert r["per_family"]["ransom_note"] == pytest.approx(sum(truth) / 3)
    ref = evaluate(scripted_user, FAMS, mode="reference", n=3, progress=False)
    assert ref["macro"] == 1.0 and ref["call_parse_rate"] == 1.0 and ref["call_valid_rate"] == 1.0
    # a user that echoes the schema instead of calling: no parseable call, nothing right
    echo = evaluate(lambda cs: [c[-1]["content"].split("You can call this tool:\n")[1].split("\n\nReply")[0]
                                for c in cs], FAMS, mode="reference", n=3, progress=False)
    assert echo["call_parse_rate"] == 0.0 and echo["macro"] == 0.0
    none = evaluate(scripted_user, FAMS, mode="none", n=3, progress=False)
    assert none["per_family"]["ransom_note"] == r["per_family"]["ransom_note"]
    # the counts behind the macro, and its binomial interval
    assert r["n_per_family"] == {"count_primes": 3, "ransom_note": 3}
    assert r["correct_per_family"] == {"count_primes": 3, "ransom_note": sum(truth)}
    lo, hi = r["macro_ci"]
    assert lo < r["macro"] < hi or r["macro"] in (lo, hi)


def test_macro_interval_is_the_exact_binomial_interval_of_the_pooled_count():
    from llmkit.tools.evaluate import macro_interval

    lo, hi = macro_interval({"a": 3, "b": 0}, {"a": 3, "b": 3})  # 3 of 6: Clopper-Pearson (0.118, 0.882)
    assert lo == pytest.approx(0.1181, abs=1e-4) and hi == pytest.approx(0.8819, abs=1e-4)
    assert macro_interval({"a": 4, "b": 4}, {"a": 4, "b": 4})[1] == 1.0
    assert macro_interval({"a": 1, "b": 1}, {"a": 2, "b": 4}) is None  # unequal counts: not a binomial proportion
    assert macro_interval({}, {}) is None


def test_cli_build_eval_input_errors(tmp_path, capsys):
    from llmkit.cli import main

    assert main(["tools", "build", "--model", "x", "--task", "nope", "--out", str(tmp_path / "p")]) == 2
    assert "unknown task family 'nope'" in capsys.readouterr().err
    assert main(["tools", "eval", "--pool", str(tmp_path / "missing"), "--user-model", "x"]) == 2
    assert "no such pool" in capsys.readouterr().err


def test_local_generator_memoizes_greedy_replies(tiny_model, tiny_tokenizer, monkeypatch):
    import llmkit.generation as g
    from llmkit.tools.evaluate import local_generator

    calls = []
    real = g.generate

    def counting(model, tok, prompts, *a, **kw):
        calls.append(len(prompts))
        return real(model, tok, prompts, *a, **kw)

    monkeypatch.setattr(g, "generate", counting)
    conv = lambda s: [{"role": "user", "content": s}]
    gen = local_generator(tiny_model, tiny_tokenizer, max_new_tokens=3)
    first = gen([conv("a"), conv("b"), conv("a")])
    assert calls == [2] and first[0] == first[2]  # the repeated prompt is generated once
    assert gen([conv("b"), conv("c")]) == [first[1], gen([conv("c")])[0]] and calls == [2, 1]
    sampled = local_generator(tiny_model, tiny_tokenizer, max_new_tokens=3, temperature=1.0)
    sampled([conv("a")]), sampled([conv("a")])
    assert calls == [2, 1, 1, 1]  # sampling is never memoized


def test_build_verified_rate_counts_verified_builds_and_buckets_each_failure():
    """One writer per failure mode: the rate counts only the reference build; each other reply lands in its own
    bucket (no spec, no code, schema mismatch, crash, wrong answers)."""
    from llmkit.tools.evaluate import BUILD_FAILURES, build_verified_rate

    ref = tasks.get("gcd").reference
    spec = {"name": ref.name, "description": "", "parameters": ref.parameters, "returns": "integer"}
    bad_schema = dict(spec, parameters={"type": "object", "properties": {"xs": {"type": "array"}}})

    def reply(code, s=spec):
        return f"```json\n{json.dumps(s)}\n```\n```python\n{code}\n```"

    replies = {
        "verified": reference_build_trace(tasks.get("gcd")),
        "no_spec": "I cannot write that.",
        "no_code": f"```json\n{json.dumps(spec)}\n```",
        "schema": reply(ref.code, bad_schema),
        "crash": reply("def gcd_of(numbers: list) -> int:\n    raise ValueError('no')"),
        "wrong": reply("def gcd_of(numbers: list) -> int:\n    return 7"),
    }
    order = list(replies)
    calls = []

    def writer(convs):
        calls.append(len(convs))
        return [replies[order[i % len(order)]] for i in range(len(convs))]

    r = build_verified_rate(writer, ["gcd"], attempts=len(order), checks=3, progress=False)
    assert calls == [len(order)] and r["attempts"] == len(order)
    assert r["rate"] == pytest.approx(1 / len(order)) and r["per_family"] == {"gcd": pytest.approx(1 / len(order))}
    assert set(r["failures"]) == set(BUILD_FAILURES) and all(v == 1 for v in r["failures"].values())
    assert r["samples"]["gcd"]["verdict"] == "verified"
    with pytest.raises(ValueError, match="attempts"):
        build_verified_rate(writer, ["gcd"], attempts=0)
