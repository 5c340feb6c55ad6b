"""Task suite: 13 families, seeded generators, exact verifiers (wrong answers rejected), reference tools."""

from __future__ import annotations

import pytest

from llmkit.tools import sandbox, tasks

needs_sandbox = pytest.mark.skipif(not sandbox.check_available()[0], reason="bubblewrap cannot run here")


def test_thirteen_families_split_disjoint():
    assert len(tasks.FAMILIES) == 13
    assert set(tasks.TRAIN_FAMILIES).isdisjoint(tasks.HELDOUT_FAMILIES)
    assert set(tasks.TRAIN_FAMILIES) | set(tasks.HELDOUT_FAMILIES) == set(tasks.FAMILIES)
    assert len(tasks.HELDOUT_FAMILIES) >= 3 and len(tasks.TRAIN_FAMILIES) >= 8
    assert sum(f.source == "reasoning_gym" for f in tasks.FAMILIES.values()) >= 8
    assert tasks.names("heldout") == tasks.HELDOUT_FAMILIES
    with pytest.raises(KeyError, match="unknown task family 'nope'"):
        tasks.names("gcd,nope")


@pytest.mark.parametrize("name", list(tasks.FAMILIES))
def test_generator_is_seeded_and_verifier_exact(name):
    fam = tasks.get(name)
    a, b = fam.generate(6, seed=3), fam.generate(6, seed=3)
    c = fam.generate(6, seed=4)
    assert [(i.question, i.args, i.answer) for i in a] == [(i.question, i.args, i.answer) for i in b]
    assert [i.args for i in a] != [i.args for i in c]
    for inst in a:
        assert inst.question and inst.answer
        assert fam.verify(inst.answer, inst)
        assert fam.verify("  " + inst.answer + " ", inst)  # whitespace is not an error
        assert not fam.verify(None, inst) and not fam.verify("", inst)
        for wrong in _wrong_answers(name, inst):
            assert not fam.verify(wrong, inst), (name, inst.answer, wrong)


def _wrong_answers(name, inst):
    ans = inst.answer
    if name in ("gcd", "lcm", "count_bits", "letter_counting", "digit_sum", "count_primes"):
        return [str(int(ans) + 1), str(int(ans) - 1), ans + "0", ans + ".5"]
    if name in ("isomorphic_strings", "ransom_note"):
        return ["False" if ans == "True" else "True", "yes", "maybe"]
    if name == "prime_factorization":
        return [ans + " × 2", ans.replace("×", "+"), "1"]
    if name == "word_sequence_reversal":
        words = [w.strip() for w in ans.split(",")]
        return [", ".join(reversed(words)), ", ".join(words[:-1])] if len(set(words)) > 1 else [ans + ", x"]
    return [ans + "x", ans[::-1] + "q", ans[:-1]]


def test_verifiers_accept_equivalent_forms():
    fam = tasks.get("prime_factorization")
    inst = tasks.Instance("prime_factorization", "q", {"n": 12}, "2 × 2 × 3")
    assert fam.verify("3 × 2 × 2", inst) and fam.verify("2 x 2 x 3", inst)
    assert not fam.verify("2 × 3", inst) and not fam.verify("2 × 2 × 3 × 1", inst)
    assert fam.to_answer([2, 2, 3]) == "2 × 2 × 3"
    b = tasks.get("isomorphic_strings")
    inst = tasks.Instance("isomorphic_strings", "q", {"s": "ab", "t": "cd"}, "True")
    assert b.verify("true", inst) and b.verify(str(True), inst) and not b.verify("1", inst)


@needs_sandbox
def test_reference_tools_solve_every_family():
    for name, fam in tasks.FAMILIES.items():
        assert fam.reference.schema_errors() == [], name
        insts = fam.generate(8, seed=tasks.EVAL_SEED_OFFSET)
        rs = sandbox.run_calls(fam.reference.code, fam.reference.name, [i.args for i in insts])
        assert all(r.ok for r in rs), (name, [r.error for r in rs])
        assert all(fam.verify(fam.to_answer(r.value), i) for r, i in zip(rs, insts)), name
