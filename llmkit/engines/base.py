"""The engine interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

from llmkit.generation import Completion, GenerationParams


class Engine(ABC):
    name: str = "base"
    model_name: str = ""
    tokenizer = None

    @abstractmethod
    def generate(self, prompts: list[str], params: GenerationParams, n: int = 1,
                 progress: bool = False) -> list[list[Completion]]:
        """``n`` completions for each already-formatted prompt, in prompt order."""

    def chat_prompt(self, messages: list[dict]) -> str:
        from llmkit.generation import chat_prompt

        return chat_prompt(self.tokenizer, messages)

    def start_streaming(self, **kwargs):
        """A started ``llmkit.engines.stream.StreamLoop`` serving this engine's model (for the server)."""
        raise NotImplementedError(f"the {self.name} engine has no streaming submission")

    def close(self) -> None:  # engines holding processes or memory release them here
        pass
