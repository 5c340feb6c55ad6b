"""transformers engine: batched ``model.generate`` with left padding."""

from __future__ import annotations

from tqdm.auto import tqdm

from llmkit.engines.base import Engine
from llmkit.generation import Completion, GenerationParams, generate


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model=None, tokenizer=None, dtype="float32", batch_size: int = 16,
                 cache_factory=None):
        """``model`` is a name (alias, folder, hub id) or an already-loaded model with ``tokenizer``.

        ``cache_factory(model) -> Cache`` makes a fresh KV cache per batch (e.g. InQuant);
        ``None`` uses transformers' default dynamic cache.
        """
        if model is None or isinstance(model, str):
            from llmkit.models import DEFAULT_MODEL, load

            self.model_name = model or DEFAULT_MODEL
            self.model, self.tokenizer = load(model, dtype=dtype)
        else:
            if tokenizer is None:
                raise ValueError("HFEngine(model=<loaded model>) needs tokenizer=")
            self.model, self.tokenizer = model, tokenizer
            self.model_name = getattr(model.config, "_name_or_path", "") or "in-memory"
        self.batch_size = batch_size
        self.cache_factory = cache_factory

    def generate(self, prompts, params: GenerationParams, n: int = 1, progress: bool = False):
        expanded = [p for p in prompts for _ in range(n)]
        out: list[Completion] = []
        bar = tqdm(total=len(expanded), desc="generate[hf]", disable=not progress, unit="seq")
        for start in range(0, len(expanded), self.batch_size):
            chunk = expanded[start : start + self.batch_size]
            extra = {}
            if self.cache_factory is not None:
                extra["past_key_values"] = self.cache_factory(self.model)
            if params.seed is not None and not params.greedy:
                # distinct but reproducible seeds per batch
                params = GenerationParams(**{**params.__dict__, "seed": params.seed + start})
            out += generate(self.model, self.tokenizer, chunk, params, batch_size=len(chunk), **extra)
            bar.update(len(chunk))
        bar.close()
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def start_streaming(self, max_batch_size: int = 32, **kwargs):
        """Background batcher: concurrent requests share batches; text streams per step."""
        from llmkit.engines.hf_batcher import HFBatcher

        return HFBatcher(self, max_batch_size=max_batch_size, **kwargs).start()
