"""The server over the vLLM engine (bundled model, eager mode): same answers as offline vLLM, streaming, n."""

from __future__ import annotations

import openai
import pytest

pytestmark = [pytest.mark.bundled, pytest.mark.vllm, pytest.mark.slow]


def test_vllm_server_matches_offline_generation_and_streams(vllm_server):
    from llmkit.generation import GenerationParams

    engine, name = vllm_server.engine, "smollm2-135m-instruct"  # the session's engine (tests/serving/conftest.py)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    ref = engine.generate([engine.chat_prompt(msgs)], GenerationParams(max_new_tokens=24))[0][0]
    client = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == ref.completion_tokens
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=24, temperature=0,
                                                 n=2, stream=True))
    for i in range(2):
        parts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].index == i]
        assert sum(1 for p in parts if p) > 2 and "".join(p or "" for p in parts) == ref.text
    cut = client.completions.create(model=name, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                    stop=[" 6"])
    assert cut.choices[0].finish_reason == "stop" and " 6" not in cut.choices[0].text
