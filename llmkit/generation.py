"""Batched text generation with transformers: the one place that calls ``model.generate``.

Prompts are already-formatted strings (``chat_prompt`` applies the chat
template). Batches are left-padded so every row's new tokens start at the
same position; stop strings are applied after decoding (the earliest match
wins) so that the result is the same whatever the batch composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (eos or stop string) or "length"
    token_ids: list[int] = field(default_factory=list)


def chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Render OpenAI-style messages with the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def truncate_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the earliest stop string; report whether one was found."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut], cut < len(text)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return ids


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[str], params: GenerationParams | None = None,
             batch_size: int = 16, **generate_kwargs) -> list[Completion]:
    """Generate one completion per prompt, ``batch_size`` prompts per ``generate`` call."""
    params = params or GenerationParams()
    out: list[Completion] = []
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        old_side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            tokenizer.padding_side = old_side
        enc = {k: v.to(model.device) for k, v in enc.items()}
        kwargs = {"max_new_tokens": params.max_new_tokens, "pad_token_id": pad_id, "do_sample": not params.greedy}
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        kwargs.update(generate_kwargs)
        seqs = model.generate(**enc, **kwargs)
        if not isinstance(seqs, torch.Tensor):
            seqs = seqs.sequences
        width = enc["input_ids"].shape[1]
        prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
        for row, plen in zip(seqs[:, width:].tolist(), prompt_lens):
            ids = []
            hit_eos = False
            for t in row:
                if t in eos:
                    hit_eos = True
                    break
                ids.append(t)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            text, hit_stop = truncate_at_stop(text, params.stop)
            if hit_stop:
                ids = tokenizer.encode(text, add_special_tokens=False)
            finish = "stop" if (hit_eos or hit_stop) else "length"
            out.append(Completion(text, int(plen), len(ids), finish, ids))
    return out
