"""vLLM (the CPU build here) imports in the installed environment and generates with the bundled model."""

from __future__ import annotations

import pytest


def test_import_vllm():
    import vllm

    assert vllm.__version__
    import torch

    # the Makefile removes torchvision (it fails beside the CPU torch); importing vllm must not need it
    assert torch.__version__.startswith("2.13")


@pytest.mark.vllm
@pytest.mark.bundled
def test_one_prompt_vllm_generation():
    from llmkit.engines import get_engine
    from llmkit.generation import GenerationParams

    eng = get_engine("vllm", enforce_eager=True)
    try:
        prompt = eng.chat_prompt([{"role": "user", "content": "Which city is the capital of France?"}])
        [[c]] = eng.generate([prompt], GenerationParams(max_new_tokens=24))
        assert c.completion_tokens > 0
        assert "Paris" in c.text, c.text
    finally:
        eng.close()
