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

    adapters: dict = {}  # noqa: RUF012 - read-only default; LoRA adapters served beside the base model: {name: folder}

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, **options) -> str:
        """The rendered prompt (a ``ChatPrompt``: its ``token_ids`` are the safe ids where content holds markup).

        ``options``: ``add_generation_prompt``, ``continue_final_message``, ``template_kwargs``
        (see ``llmkit.generation.render_chat``).
        """
        from llmkit.generation import chat_prompt

        return chat_prompt(self.tokenizer, messages, tools=tools, **options)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **options) -> list[int]:
        """Prompt token ids where message content is text (see ``llmkit.generation.encode_chat``)."""
        from llmkit.generation import encode_chat

        return encode_chat(self.tokenizer, messages, tools=tools, **options)

    def load_adapters(self, adapters: dict[str, str]) -> None:
        raise NotImplementedError(f"the {self.name} engine cannot serve LoRA adapters")

    def compile_grammar(self, guided: dict):
        """What ``StreamRequest.grammar`` takes for ``params.guided`` (None: the engine does it from params)."""
        return

    def start_streaming(self, **kwargs):
        """A started ``llmkit.engines.stream.StreamLoop`` serving this engine's model (for the server)."""
        raise NotImplementedError(f"the {self.name} engine has no streaming submission")

    def close(self) -> None:  # engines holding processes or memory release them here
        pass
