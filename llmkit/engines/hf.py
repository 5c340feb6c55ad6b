"""transformers engine: batched generation with left padding.

Greedy requests without a custom KV cache run llmkit's own decode loop
(``hf_batcher.greedy_generate``): the same inputs as ``model.generate`` on the same
batch, but finished rows leave the batch (and the cache) at once, a row also
ends as soon as a stop string is certain, and prefill computes the last
position's logits only. The text equals ``generate()``'s (tested). Sampling
and custom caches go through ``model.generate`` (its sampling defaults,
e.g. top_k, and any cache class work unchanged). Requests using vLLM's
extras (``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ...), which
``model.generate`` has no exact twin for, run through the serving batcher.
"""

from __future__ import annotations

from tqdm.auto import tqdm

from llmkit.engines.base import Engine
from llmkit.generation import Completion, GenerationParams, generate


class HFEngine(Engine):
    name = "hf"

    def __init__(self, model=None, tokenizer=None, dtype="float32", batch_size: int = 16,
                 cache_factory=None, device: str | None = "cpu", device_map=None, trust_remote_code: bool = False):
        """``model`` is a name (alias, folder, hub id) or an already-loaded model with ``tokenizer``.

        ``cache_factory(model) -> Cache`` makes a fresh KV cache per batch (e.g. InQuant);
        ``None`` uses transformers' default dynamic cache. ``device`` ("cpu", "cuda", "cuda:1")
        places the loaded model; ``device_map`` ("auto", or a dict) instead spreads it with
        accelerate (then ``device`` is ignored). Inputs follow the model's first device.
        """
        self.adapters: dict[str, str] = {}
        self._grammar_compiler = None
        if model is None or isinstance(model, str):
            from llmkit.models import DEFAULT_MODEL, load

            self.model_name = model or DEFAULT_MODEL
            kw = {"trust_remote_code": True} if trust_remote_code else {}
            if device_map is not None:
                kw["device_map"] = device_map
                device = None
            self.model, self.tokenizer = load(model, dtype=dtype, device=device, **kw)
        else:
            if tokenizer is None:
                raise ValueError("HFEngine(model=<loaded model>) needs tokenizer=")
            self.model, self.tokenizer = model, tokenizer
            self.model_name = getattr(model.config, "_name_or_path", "") or "in-memory"
        self.batch_size = batch_size
        self.cache_factory = cache_factory
        from llmkit.engines.hf_batcher import use_gqa_sdpa

        use_gqa_sdpa(self.model)

    def generate(self, prompts, params: GenerationParams, n: int = 1, progress: bool = False):
        if _uses_vllm_extras(params):
            return self._via_batcher(prompts, params, n)
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
            if params.greedy and self.cache_factory is None:
                out += self._greedy(chunk, params)
            else:
                out += generate(self.model, self.tokenizer, chunk, params, batch_size=len(chunk), **extra)
            bar.update(len(chunk))
        bar.close()
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _via_batcher(self, prompts, params: GenerationParams, n: int) -> list[list[Completion]]:
        from llmkit.engines.hf_batcher import HFBatcher
        from llmkit.engines.stream import collect
        from llmkit.generation import prompt_ids

        ids = [prompt_ids(self.tokenizer, p) for p in prompts for _ in range(n)]
        per = [GenerationParams(**{**params.__dict__, "seed": params.seed + k % n})
               if params.seed is not None else params for k in range(len(ids))]
        loop = HFBatcher(self, max_batch_size=self.batch_size).start()
        try:
            out = collect(loop, ids, per)
        finally:
            loop.stop()
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _greedy(self, prompts: list[str], params: GenerationParams) -> list[Completion]:
        from llmkit.engines.hf_batcher import greedy_generate
        from llmkit.generation import _eos_ids, prompt_ids, truncate_at_stop

        tok = self.tokenizer
        ids = [prompt_ids(tok, p) for p in prompts]
        if not all(ids):  # an empty prompt: leave it to generate()
            return generate(self.model, tok, prompts, params, batch_size=len(prompts))
        eos = _eos_ids(self.model, tok)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos), 0)
        rows = greedy_generate(self.model, ids, params.max_new_tokens, eos, pad_id,
                               stop_reached=_stop_reached(tok, params.stop))
        out = []
        for row_ids, (new, hit_eos) in zip(ids, rows):
            # exactly what generation.generate() makes of its output row
            text, hit_stop = truncate_at_stop(tok.decode(new, skip_special_tokens=True), params.stop)
            if hit_stop:
                new = tok.encode(text, add_special_tokens=False)
            out.append(Completion(text, len(row_ids), len(new), "stop" if (hit_eos or hit_stop) else "length",
                                  new))
        return out

    def load_adapters(self, adapters: dict[str, str]) -> None:
        """Load PEFT LoRA adapters ``{name: folder}`` beside the base weights (one model, named adapters).

        The server then picks the adapter per request and PEFT runs a batch with a different
        adapter per row (``adapter_names``); ``__base__`` rows see the base model.
        """
        from peft import PeftModel

        for name, path in adapters.items():
            if name in self.adapters or name == "__base__":
                raise ValueError(f"adapter name '{name}' is used twice or reserved")
            if not isinstance(self.model, PeftModel):
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            else:
                self.model.load_adapter(path, adapter_name=name)
            self.adapters[name] = str(path)
        self.model.eval()

    def compile_grammar(self, guided: dict):
        """An xgrammar ``CompiledGrammar`` for ``{"json": schema}`` or ``{"json_object": True}``."""
        import xgrammar as xgr

        from llmkit.generation import _eos_ids

        if self._grammar_compiler is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab,
                                                      stop_token_ids=sorted(_eos_ids(self.model, self.tokenizer)))
            self._grammar_compiler = xgr.GrammarCompiler(info)
        if guided.get("json") is not None:
            schema = guided["json"]
            return self._grammar_compiler.compile_json_schema(schema if isinstance(schema, str) else
                                                              __import__("json").dumps(schema), any_whitespace=False)
        if guided.get("json_object"):
            return self._grammar_compiler.compile_builtin_json_grammar()
        raise ValueError(f"unknown guided decoding request {guided}")

    def start_streaming(self, max_batch_size: int = 32, **kwargs):
        """Background batcher: concurrent requests share batches; text streams per step."""
        from llmkit.engines.hf_batcher import HFBatcher

        return HFBatcher(self, max_batch_size=max_batch_size, **kwargs).start()


def _uses_vllm_extras(params: GenerationParams) -> bool:
    defaults = GenerationParams()
    return any(getattr(params, k) != getattr(defaults, k) for k in (
        "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens"))


def _stop_reached(tok, stop: list[str]):
    """``ids -> bool``: true once the text holds a stop string that more tokens cannot move.

    ``generate()`` cuts the finished text at the earliest stop string. A match found now is
    final unless a different (longer) stop string starting before it is still incomplete, so
    the row only ends when the match lies at least the longest stop string (plus a few
    characters for undecoded bytes or space clean-up) before the end of the text.
    """
    stops = [s for s in stop if s]
    if not stops:
        return None
    margin = max(len(s) for s in stops) + 4

    def reached(ids: list[int]) -> bool:
        text = tok.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stops) if i != -1), default=-1)
        return cut != -1 and cut + margin <= len(text.rstrip("\ufffd"))

    return reached
