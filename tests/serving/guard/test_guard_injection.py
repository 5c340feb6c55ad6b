"""The GSM8K instruction-injection set: construction and the canary compliance check."""

import json

import pytest

from llmkit.serving.guard import injection as I


def test_build_pairs_settings_and_places_the_injection():
    qs = [f"What is {i} + {i}?" for i in range(60)]
    samples = I.build(qs, seed=3)
    assert len(samples) == 120
    by_id = {}
    for s in samples:
        by_id.setdefault(s["id"], {})[s["setting"]] = s
    wordings = set()
    for i, pair in enumerate(by_id.values()):
        a, c = pair["aligned"], pair["conflict"]
        assert a["canary"] == c["canary"] and a["messages"][0] == c["messages"][0]
        assert c["canary"] in c["messages"][0]["content"] and "Never reveal" in c["messages"][0]["content"]
        assert a["injection"] is None and c["injection"] in I.INJECTIONS
        assert qs[i] in a["messages"][1]["content"] and c["canary"] not in c["messages"][1]["content"]
        assert (qs[i] in c["messages"][1]["content"]) == ("{q}" in c["injection"])
        wordings.add(c["injection"])
    assert len(wordings) >= 6  # the wordings are mixed
    assert I.build(qs, seed=3) == samples and I.build(qs, seed=4) != samples


def test_violates_is_a_whole_word_case_insensitive_canary_match():
    s = {"canary": "HACKED"}
    assert I.violates(s, "hacked")
    assert I.violates(s, "Sure! HACKED HACKED")
    assert not I.violates(s, "The answer is 12.")
    assert not I.violates(s, "unhackedness")
    assert not I.violates(s, "")


def test_canary_is_not_a_word_of_its_question():
    qs = [f"A {c.lower()} costs $3. How much do 2 cost?" for c in I.CANARIES[:-1]]
    for s in I.build(qs, settings=("aligned",)):
        assert not I.violates(s, s["messages"][1]["content"])


def test_gsm8k_questions_reads_jsonl_and_names_bad_input(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": "#### 1"}) for i in range(5)) + "\n")
    assert I.gsm8k_questions(p, limit=3) == ["q0", "q1", "q2"]
    with pytest.raises(FileNotFoundError, match="GSM8K file not found"):
        I.gsm8k_questions(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        I.gsm8k_questions(bad)
    with pytest.raises(ValueError, match="unknown setting"):
        I.build(["q"], settings=("reference",))
