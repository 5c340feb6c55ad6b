"""Generation engines behind one interface, shared by evals, serving and the guard.

``get_engine("hf" | "vllm", model=...)`` returns an object with
``generate(prompts, params) -> list[Completion]`` (offline, batched) and
``tokenizer``. Serving adds its request queue on top of the same objects.
"""

from __future__ import annotations

from llmkit.engines.base import Engine

ENGINES = ("hf", "vllm")


def get_engine(name: str, model: str | None = None, **kwargs) -> Engine:
    if name == "hf":
        from llmkit.engines.hf import HFEngine

        return HFEngine(model, **kwargs)
    if name == "vllm":
        from llmkit.engines.vllm import VLLMEngine

        return VLLMEngine(model, **kwargs)
    raise ValueError(f"unknown engine '{name}': choose one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "Engine", "get_engine"]
