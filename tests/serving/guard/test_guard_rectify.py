"""Latent rectification: the guard watches generation and shifts a row's states once its score crosses."""

from __future__ import annotations

import random

import pytest
import torch

from llmkit.generation import GenerationParams, chat_prompt, generate
from llmkit.serving.guard import Guard
from llmkit.serving.guard.rectify import generate_rectified


def conv(user, response=None):
    m = [{"role": "system", "content": "Always answer in French."}, {"role": "user", "content": user}]
    return m if response is None else [*m, {"role": "assistant", "content": response}]


@pytest.fixture()
def setup(tiny_model, tiny_tokenizer):
    torch.set_num_threads(1)  # conftest restores it after the test
    torch.manual_seed(0)
    rng = random.Random(0)
    words = ["bonjour", "merci", "oui", "le chat", "la maison"]
    data = [conv(f"q {i}", " ".join(rng.choice(words) for _ in range(6))) for i in range(20)]
    guard = Guard.fit(tiny_model, tiny_tokenizer, data, model_name="tiny", layers=[1, 2], n_components=4)
    prompts = [conv(f"question number {i}") for i in range(5)]
    return tiny_model, tiny_tokenizer, guard, prompts


def test_watch_only_equals_greedy_generation(setup):
    model, tok, guard, prompts = setup
    params = GenerationParams(max_new_tokens=12, temperature=0.0)
    plain = generate(model, tok, [chat_prompt(tok, m) for m in prompts], params, batch_size=5)
    watched = generate_rectified(model, tok, guard, prompts, params, alpha=0.0, min_tokens=2, check_every=1,
                                 threshold=float("-inf"), batch_size=5)
    assert [w.text for w in watched] == [p.text for p in plain]
    # with a threshold that always fires, every row is flagged at min_tokens (alpha 0: nothing changes)
    assert all(w.triggered_at == 2 for w in watched if w.completion.completion_tokens > 2)
    never = generate_rectified(model, tok, guard, prompts, params, alpha=0.5, threshold=float("inf"), batch_size=5)
    assert [w.text for w in never] == [p.text for p in plain] and all(w.triggered_at is None for w in never)


def test_running_score_matches_teacher_forced_states(setup):
    # the score the monitor computes at the trigger equals the guard's score of the same tokens, teacher-forced
    from llmkit.generation import encode_chat
    from llmkit.serving.guard.capture import Capture

    model, tok, guard, prompts = setup
    params = GenerationParams(max_new_tokens=12, temperature=0.0)
    watched = generate_rectified(model, tok, guard, prompts[:2], params, alpha=0.0, min_tokens=5,
                                 threshold=float("-inf"), batch_size=2)
    for m, w in zip(prompts[:2], watched):
        assert w.triggered_at == 5
        p_ids = encode_chat(tok, m)
        ids = torch.tensor([p_ids + w.completion.token_ids[:5]])
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        cap = Capture(states={l: hs[l][0, len(p_ids):].float() for l in guard.layers}, n_tokens=5)
        assert w.trigger_score == pytest.approx(float(guard.score_captures([cap])[0]), rel=1e-3, abs=1e-3)


def test_rectification_keeps_the_prefix_and_changes_what_follows(setup):
    model, tok, guard, prompts = setup
    params = GenerationParams(max_new_tokens=16, temperature=0.0)
    plain = generate_rectified(model, tok, guard, prompts, params, alpha=0.0, batch_size=5)
    steered = generate_rectified(model, tok, guard, prompts, params, alpha=1.0, min_tokens=4,
                                 threshold=float("-inf"), batch_size=5)
    changed = 0
    for p, s in zip(plain, steered):
        k = s.triggered_at
        assert k == 4
        # tokens up to and including the one chosen at the trigger come from unsteered states
        assert s.completion.token_ids[: k + 1] == p.completion.token_ids[: k + 1]
        changed += s.completion.token_ids != p.completion.token_ids
    assert changed >= 1


def test_steering_shift_is_alpha_times_the_drift_from_the_compliant_mean(setup):
    # the first steered step feeds the same token on the same (unsteered) cache, so at the steered layer
    # its state is exactly the plain one plus alpha * (mu - mean of the trajectory so far)
    from llmkit.serving.guard import rectify as R

    model, tok, guard, prompts = setup
    seen = []
    orig_close = R._Monitor.close

    def close(self):
        seen.append(self)
        orig_close(self)

    R._Monitor.close = close
    try:
        params = GenerationParams(max_new_tokens=8, temperature=0.0)
        generate_rectified(model, tok, guard, prompts[:1], params, alpha=0.0, min_tokens=4, threshold=float("-inf"))
        generate_rectified(model, tok, guard, prompts[:1], params, alpha=0.5, min_tokens=4, threshold=float("-inf"),
                           steer_layers=[1])
    finally:
        R._Monitor.close = orig_close
    plain, steered = seen
    mu = guard.manifolds[1].mean
    drift = mu - torch.stack(plain.steps[1][:4])[:, 0].mean(0)
    for t in range(4):
        assert torch.allclose(steered.steps[1][t], plain.steps[1][t])
    assert torch.allclose(steered.steps[1][4][0] - plain.steps[1][4][0], 0.5 * drift, atol=1e-4)
    before = (plain.steps[1][4][0] - mu).norm()
    assert (steered.steps[1][4][0] - mu).norm() < before or drift.norm() < 1e-6


def test_bad_arguments_are_named(setup):
    model, tok, guard, prompts = setup
    with pytest.raises(ValueError, match="greedy"):
        generate_rectified(model, tok, guard, prompts, GenerationParams(max_new_tokens=4, temperature=0.7))
    with pytest.raises(ValueError, match="alpha"):
        generate_rectified(model, tok, guard, prompts, GenerationParams(max_new_tokens=4, temperature=0.0), alpha=2)
    with pytest.raises(ValueError, match="not guard layers"):
        generate_rectified(model, tok, guard, prompts, GenerationParams(max_new_tokens=4, temperature=0.0),
                           steer_layers=[3])


def _plain_and_captures(model, tok, guard, prompts, params):
    # teacher-forced captures of the generated ids (the tiny byte-level tokenizer's random output does not
    # survive a decode/encode round trip, so the ids go in as they were generated)
    from llmkit.generation import encode_chat
    from llmkit.serving.guard.capture import Capture

    plain = generate_rectified(model, tok, guard, prompts, params, alpha=0.0, threshold=float("inf"), batch_size=1)
    caps = []
    for m, p in zip(prompts, plain):
        p_ids = encode_chat(tok, m)
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([p_ids + p.completion.token_ids]), output_hidden_states=True).hidden_states
        caps.append(Capture(states={l: hs[l][0, len(p_ids):].float() for l in guard.layers},
                            n_tokens=len(p.completion.token_ids)))
    return [p.text for p in plain], [p.completion.token_ids for p in plain], caps


@pytest.mark.parametrize("threshold", ["always", "median"])
def test_rectifying_from_captures_equals_live_rectified_generation(setup, threshold):
    # the replay must reproduce the live run: same trigger points, same scores, same texts
    from llmkit.serving.guard.rectify import rectify_from_captures, trigger_point

    model, tok, guard, prompts = setup
    params = GenerationParams(max_new_tokens=16, temperature=0.0)
    texts, ids, caps = _plain_and_captures(model, tok, guard, prompts, params)
    if threshold == "always":
        thr = float("-inf")
    else:  # a threshold some rows cross (after their first check) and some never
        from llmkit.serving.guard.capture import Capture

        def running(c):
            return [float(guard.layer_z([Capture(states={l: c.states[l][:t] for l in guard.layers}, n_tokens=t)])[0]
                          .mean()) for t in range(3, c.n_tokens + 1, 2)]

        highest = sorted({max(running(c)) for c in caps if c.n_tokens >= 3})
        assert len(highest) >= 2, "the tiny setup needs answers with different score paths"
        thr = (highest[0] + highest[1]) / 2  # away from any row's score: numerics cannot decide a check
        assert trigger_point(guard, caps[0], threshold=float("-inf"), min_tokens=3, check_every=2)[0] == 3
    kw = {"alpha": 1.0, "min_tokens": 3, "check_every": 2, "threshold": thr}
    live = generate_rectified(model, tok, guard, prompts, params, batch_size=1, **kw)
    replay = rectify_from_captures(model, tok, guard, prompts, texts, caps, params, response_ids=ids, batch_size=3,
                                   **kw)
    assert [r.triggered_at for r in replay] == [w.triggered_at for w in live]
    for r, w in zip(replay, live):
        if w.trigger_score is not None:
            assert r.trigger_score == pytest.approx(w.trigger_score, rel=1e-3, abs=1e-3)
    assert [r.text for r in replay] == [w.text for w in live]
    fired = [r for r in replay if r.triggered_at is not None]
    assert fired and (threshold == "always" or len(fired) < len(prompts))
    if threshold == "always":  # fired early: the steering changed some continuation
        assert any(r.text != t for r, t in zip(replay, texts))
    # unflagged answers come back untouched, and without a generation
    assert all(r.text == t and r.completion is None for r, t in zip(replay, texts) if r.triggered_at is None)


def test_rectifying_from_captures_rejects_mismatched_inputs(setup):
    from llmkit.serving.guard.rectify import rectify_from_captures

    model, tok, guard, prompts = setup
    params = GenerationParams(max_new_tokens=8, temperature=0.0)
    texts, _, caps = _plain_and_captures(model, tok, guard, prompts[:2], params)
    with pytest.raises(ValueError, match="one of each"):
        rectify_from_captures(model, tok, guard, prompts[:2], texts, caps[:1], params)
    with pytest.raises(ValueError, match="captures must be of these responses"):
        rectify_from_captures(model, tok, guard, prompts[:2], ["", ""], caps, params, threshold=float("-inf"),
                              min_tokens=1)
    with pytest.raises(ValueError, match="greedy"):
        rectify_from_captures(model, tok, guard, prompts[:2], texts, caps, GenerationParams(temperature=0.7))
