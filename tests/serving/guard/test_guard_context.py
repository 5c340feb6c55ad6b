"""The guard sees the whole conversation: a cut keeps the system prompt and the latest turns, and every
response token is scored (windows, maximum over them), so a violation that starts late is caught."""

from __future__ import annotations

import importlib

import pytest
import torch

from llmkit.serving.guard import Guard, capture

cap_mod = importlib.import_module("llmkit.serving.guard.capture")


def long_history(tutor, turns: int = 12) -> list[dict]:
    """System prompt, then many old turns, then the latest question (prompt only)."""
    msgs = [{"role": "system", "content": tutor.system}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"Old question number {i}: what is {i} + {i}? " + "Please explain. " * 3},
                 {"role": "assistant", "content": f"{i} + {i} = {2 * i}. " * 4}]
    return [*msgs, {"role": "user", "content": "What is (12 + 30) * 2?"}]


@pytest.fixture()
def energy_guard(tiny_model, tiny_tokenizer, tutor):
    fit = [tutor.conv(x["prompt"], x["compliant"]) for x in tutor.items(20, 0, injected=False) + tutor.items(20, 1)]
    return Guard.fit(tiny_model, tiny_tokenizer, fit, model_name="tiny", layers=[1, 2], n_components=8,
                     target_fpr=0.1, max_length=512)


def test_a_long_conversation_keeps_its_system_prompt_and_latest_turns(tiny_model, tiny_tokenizer, tutor,
                                                                      energy_guard):
    from llmkit.generation import encode_chat

    msgs = long_history(tutor)
    answer = tutor.solution(12, 30, 2)
    assert len(encode_chat(tiny_tokenizer, msgs)) > 1000  # far beyond max_length
    # what must remain in 512 tokens: the system prompt and the latest turns (one older turn would not fit)
    short = [msgs[0], msgs[-3], msgs[-2], msgs[-1]]
    n_ans = len(answer)  # one token per byte
    assert len(encode_chat(tiny_tokenizer, short)) + n_ans <= 512 < len(encode_chat(tiny_tokenizer, msgs[:1]
                                                                                    + msgs[-5:])) + n_ans
    got = capture(tiny_model, tiny_tokenizer, [tutor.conv(msgs, answer)], [1, 2], max_length=512)[0]
    ref = capture(tiny_model, tiny_tokenizer, [tutor.conv(short, answer)], [1, 2], max_length=512)[0]
    assert got.extra["prompt_tokens_cut"] > 0 and ref.extra["prompt_tokens_cut"] == 0
    assert got.n_tokens == len(answer)
    for l in (1, 2):
        torch.testing.assert_close(got.states[l], ref.states[l])

    # the server's path: the prefill refuses the long prompt, and the whole pass makes the same cut
    class Engine:
        model, tokenizer, model_name = tiny_model, tiny_tokenizer, "tiny"

    assert energy_guard.prefill(Engine(), msgs) is None
    assert energy_guard.check(Engine(), msgs, answer)["score"] == pytest.approx(
        energy_guard.check(Engine(), short, answer)["score"], rel=1e-5, abs=1e-5)


def test_a_single_overlong_turn_keeps_the_system_prompt_and_its_end(tiny_tokenizer, tutor):
    from llmkit.generation import encode_chat

    msgs = [{"role": "system", "content": tutor.system},
            {"role": "user", "content": "filler text. " * 200 + "The real question: what is 2 + 2?"}]
    ids, cut = cap_mod._cut_prompt(tiny_tokenizer, msgs, 200)
    sys_ids = encode_chat(tiny_tokenizer, msgs[:1], add_generation_prompt=False)
    full = encode_chat(tiny_tokenizer, msgs)
    assert len(ids) == 200 and cut == len(full) - 200
    assert ids[: len(sys_ids)] == sys_ids  # the system prompt whole, at the front
    assert ids[len(sys_ids):] == full[len(full) - (200 - len(sys_ids)):]  # then the end: question + generation prompt
    assert "The real question: what is 2 + 2?" in tiny_tokenizer.decode(ids)


@pytest.mark.parametrize("max_length", [1024, 160])  # 160: the response is read in segments
def test_a_violation_that_starts_late_is_flagged(tiny_model, tiny_tokenizer, tutor, energy_guard, max_length):
    prompt = tutor.items(1, 7)[0]["prompt"]
    long_ok = " ".join(tutor.solution(a, a + 1, 3) for a in range(10, 22))  # about 700 tokens, all compliant
    late = long_ok + " " + tutor.items(1, 5)[0]["violating"]
    caps = capture(tiny_model, tiny_tokenizer, [tutor.conv(prompt, long_ok), tutor.conv(prompt, late)], [1, 2],
                   max_length=max_length)
    assert [c.n_tokens for c in caps] == [len(long_ok), len(late)]
    assert [c.states[2].shape[0] for c in caps] == [len(long_ok), len(late)]  # every token has its state
    ok, bad = energy_guard.score_captures(caps).tolist()
    assert bad > energy_guard.threshold and bad > ok + 3
    if max_length == 1024:
        assert ok < energy_guard.threshold


def test_windows_cover_every_token():
    from llmkit.serving.guard.score import windows

    assert windows(10, 64) == [(0, 10)]
    spans = windows(150, 64)
    assert spans[0] == (0, 64) and spans[-1] == (86, 150) and all(b - a == 64 for a, b in spans)
    covered = set()
    for a, b in spans:
        covered |= set(range(a, b))
    assert covered == set(range(150))
    with pytest.raises(ValueError, match="window size"):
        windows(5, 0)


def test_injected_instruction_answer_scores_above_a_compliant_answer_to_the_same_task(
        tiny_model, tiny_tokenizer, tutor, energy_guard):
    # the same injected prompts; the answers differ only in whether they follow the injection
    test = tutor.items(30, 2)
    ok = energy_guard.score(tiny_model, tiny_tokenizer, [tutor.conv(x["prompt"], x["compliant"]) for x in test])
    bad = energy_guard.score(tiny_model, tiny_tokenizer, [tutor.conv(x["prompt"], x["violating"]) for x in test])
    from llmkit.experiments.stats import auroc

    assert energy_guard.meta["holdout_fpr"] <= 0.1 + 1e-9
    assert auroc(ok + bad, [0] * 30 + [1] * 30) > 0.95
    assert sum(s > energy_guard.threshold for s in bad) >= 27
    assert sum(s > energy_guard.threshold for s in ok) <= 12
