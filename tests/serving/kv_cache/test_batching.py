"""InQuant inside the transformers engine's continuous batching (per-token groups + calibration)."""

from __future__ import annotations

import time

import pytest
import torch

from llmkit.engines.hf import HFEngine
from llmkit.engines.stream import StreamRequest
from llmkit.generation import GenerationParams
from llmkit.serving.kv_cache import InQuantCache, cache_factory, calibrate
from llmkit.testing import tiny_llama, tiny_tokenizer


def _run(loop, tok, jobs, hooks_after=None):
    """Submit ``jobs`` (name -> (prompt, max_tokens)); ``hooks_after[name] = (at, [names])`` submits
    those names once ``name`` has produced ``at`` tokens (on the engine thread)."""
    results, fired = {}, set()

    def submit(name):
        prompt, n = jobs[name]
        parts = []

        def on_event(ev):
            parts.append(ev.text)
            hook = (hooks_after or {}).get(name)
            if hook and not ev.finish_reason and ev.n_tokens >= hook[0] and name not in fired:
                fired.add(name)
                for other in hook[1]:
                    submit(other)
            if ev.finish_reason:
                results[name] = ("".join(parts), ev.n_tokens, ev.finish_reason, ev.error)

        loop.submit(StreamRequest(tok(prompt, add_special_tokens=False)["input_ids"],
                                  GenerationParams(max_new_tokens=n), on_event))
    return results, submit


def _wait(results, n, timeout=120):
    deadline = time.time() + timeout
    while len(results) < n and time.time() < deadline:
        time.sleep(0.05)


@pytest.fixture()
def calibrated():
    model, tok = tiny_llama(), tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    cal = calibrate(model, [torch.randint(3, len(tok), (96,), generator=g) for _ in range(2)], sample_tokens=64)
    return model, tok, cal


def test_inquant_per_token_cache_batches_continuously_and_answers_do_not_change(calibrated):
    model, tok, cal = calibrated
    factory = cache_factory("inquant", layout="per-token", calibration=cal, gate="off", n_outliers=2)
    assert factory(model).rows_mergeable
    jobs = {"A": ("a long first prompt, wider than the others", 12), "B": ("hi", 20), "C": ("medium size", 16)}
    loop = HFEngine(model, tok, cache_factory=factory).start_streaming(max_batch_size=8)
    try:
        results, submit = _run(loop, tok, jobs, {"A": (3, ["B", "C"])})
        submit("A")
        _wait(results, 3)
    finally:
        loop.stop()
    assert loop.joined == 2 and loop.max_batch_seen == 3  # B and C joined A's running batch
    # each request alone (its own cache, nobody else in the batch) gives the same answer
    for name, job in jobs.items():
        solo = HFEngine(model, tok, cache_factory=factory).start_streaming(max_batch_size=8)
        try:
            ref, submit = _run(solo, tok, {name: job})
            submit(name)
            _wait(ref, 1)
        finally:
            solo.stop()
        assert results[name] == ref[name], name


def test_caches_without_shared_descriptors_keep_static_batching():
    model = tiny_llama()
    assert not InQuantCache(model.config, layout="per-token").rows_mergeable  # descriptors from each prompt
    assert not InQuantCache(model.config).rows_mergeable  # per-channel groups cannot be cut at any column


def test_merge_refuses_different_descriptors():
    from llmkit.serving.kv_cache.layers import InQuantTokenLayer

    a, b = InQuantTokenLayer(n_outliers=1, gate="off"), InQuantTokenLayer(n_outliers=1, gate="off")
    x = torch.randn(1, 2, 4, 16)
    y = x.clone()
    y[..., 7] += 50.0  # another outlier channel
    a.update(x, x)
    b.update(y, y)
    with pytest.raises(ValueError, match="different descriptors"):
        a.merge_rows(b, 4)
