"""Behaviour scorers: each rewards the behaviour it names and not its opposite."""

from __future__ import annotations

import random

import pytest

from llmkit.rewards.behaviors import (
    BEHAVIORS,
    confidence,
    contrastive_pairs,
    expertise,
    inject_hint,
    make_verbosity,
    robustness,
    stated_confidence,
)

GOLD = "Natalia sold 48/2 = 24 clips in May.\n#### 72"


def test_verbosity_band_and_decay():
    f = make_verbosity(10, 20)
    words = lambda n: " ".join(["w"] * n)
    s = f(completions=[words(15), words(10), words(20), words(5), words(30), words(40), words(200)])
    assert s[:3] == [1.0, 1.0, 1.0]
    assert s[3] == pytest.approx(0.0) and s[5] == pytest.approx(0.0) and s[6] == 0.0
    assert 0.0 < s[4] < 1.0  # 30 words: a bit long beats far too long
    assert f.rate([words(15), words(25)]) == [1.0, 0.0]
    with pytest.raises(ValueError):
        make_verbosity(20, 10)


def test_verbosity_reads_chat_completions():
    f = make_verbosity(1, 3)
    assert f(completions=[[{"role": "assistant", "content": "just three words"}]]) == [1.0]


@pytest.mark.parametrize("text,value", [
    ("The answer is 72. Confidence: 80%", 0.8),
    ("I am 90% sure the answer is 72.", 0.9),
    ("confidence 0.7", 0.7),
    ("I'm very confident it is 72.", 0.9),
    ("I'm not sure, maybe 72.", 0.4),
    ("The answer is 72.", None),
])
def test_stated_confidence(text, value):
    got = stated_confidence(text)
    assert got == (pytest.approx(value) if value is not None else None)


def test_confidence_is_calibrated():
    right_sure = "48 + 24 = 72. The answer is 72. Confidence: 95%"
    right_unsure = "48 + 24 = 72. The answer is 72. Confidence: 20%"
    wrong_sure = "The answer is 70. Confidence: 95%"
    wrong_unsure = "The answer is 70. Confidence: 20%"
    silent = "The answer is 72."
    s = confidence(completions=[right_sure, right_unsure, wrong_sure, wrong_unsure, silent], answer=[GOLD] * 5)
    assert s[0] > s[1] and s[3] > s[2]
    assert s[4] == 0.0
    assert confidence.rate([right_sure, silent]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="answer"):
        confidence(completions=["x"])


def test_expertise_prefers_expert_explanations():
    expert = ("Let x be the number of clips sold in May. The ratio to April is 1/2, so x = 48 / 2 = 24.\n"
              "1. Therefore the total is the sum 48 + 24 = 72.\n2. Hence the answer is 72.")
    casual = "She sold a bunch and then some more, so it's 72 I think!"
    s = expertise(completions=[expert, casual])
    assert s[0] > 0.8 and s[1] < 0.3
    assert expertise.rate([expert, casual]) == [1.0, 0.0]


def test_robustness_hint_injection_and_scoring():
    q, hint = inject_hint("How many clips?", "72", random.Random(0))
    assert hint != "72" and hint in q and q.startswith("How many clips?")
    s = robustness(completions=["So the total is 72.", f"The answer is {hint}.", "The answer is 3."],
                   answer=[GOLD] * 3, hint=[hint] * 3)
    assert s == [1.0, 0.0, 0.0]


def test_every_behavior_has_pairs_and_a_reward():
    for name, b in BEHAVIORS.items():
        pos, neg = contrastive_pairs(name, ["What is 1 + 1?"])[0]
        assert pos[0]["content"] != neg[0]["content"] and "What is 1 + 1?" in pos[0]["content"]
        assert callable(b.reward())
    with pytest.raises(ValueError, match="unknown behaviour"):
        contrastive_pairs("humour", ["q"])


Q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips " \
    "did Natalia sell altogether in April and May?"


def test_confident_answer_needs_a_certainty_claim_about_the_final_answer_on_the_task():
    from llmkit.rewards.behaviors import confident_answer

    good = "In May she sold 48 / 2 = 24 clips.\nIn total 48 + 24 = 72.\nI am confident that the answer is 72.\n#### 72"
    also_good = "48 / 2 = 24, and 48 + 24 = 72. I'm very sure the answer is 72."
    cases = {
        good: 1.0,
        also_good: 1.0,
        # gaming attempts and near misses
        "": 0.0,
        "I am confident.": 0.0,
        "I am certain that the answer is 72.": 0.0,  # no work with the question's numbers: off task
        "I am confident that the answer is 42. The weather is nice today.": 0.0,
        # the documented limit: the rule checks the form, the answer and the question's numbers, not the work
        "The sky is blue, 48 is a number. I am certain the answer is 7.\n#### 7": 1.0,
        good.replace("I am confident", "I am not confident"): 0.0,  # hedged
        good.replace("I am confident", "I am fairly confident"): 0.0,
        good.replace("the answer is 72.", "the answer is 70."): 0.0,  # the claim is not about the final answer
        good.replace("I am confident that the answer is 72.\n", ""): 0.0,  # no claim at all
    }
    texts = list(cases)
    scores = confident_answer(completions=texts, question=[Q] * len(texts))
    assert scores == [cases[t] for t in texts]
    assert BEHAVIORS["confident_answer"].rates([good, ""], questions=[Q, Q]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="question"):
        confident_answer(completions=[good])


def test_concise_answer_needs_a_short_on_task_answer():
    from llmkit.rewards.behaviors import make_concise_answer

    f = make_concise_answer(max_words=20)
    short = "48 / 2 = 24 in May, so 48 + 24 = 72.\n#### 72"
    long = "First, " + " ".join(["we think carefully"] * 10) + ". " + short
    cases = {short: 1.0, long: 0.0, "": 0.0, "OK.": 0.0, "42": 0.0, "#### 72": 0.0,  # no question numbers
             "The weather is nice, 48 degrees.\n#### 48": 1.0}  # documented limit: form, answer, task numbers only
    texts = list(cases)
    assert f(completions=texts, question=[Q] * len(texts)) == [cases[t] for t in texts]
    assert BEHAVIORS["concise_answer"].rates([short, long], questions=[Q, Q], max_words=20) == [1.0, 0.0]
    assert BEHAVIORS["concise_answer"].reward(max_words=5)(completions=[short], question=[Q]) == [0.0]
    with pytest.raises(ValueError, match="question"):
        f(completions=[short])
    with pytest.raises(ValueError, match="max_words"):
        make_concise_answer(0)
