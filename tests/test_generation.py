from __future__ import annotations

import torch

from llmkit.generation import GenerationParams, chat_prompt, generate, truncate_at_stop


def test_tiny_tokenizer_round_trips_and_templates(tiny_tokenizer):
    text = "Héllo, wörld! 12 + 30 = 42"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert tiny_tokenizer.decode(ids) == text
    prompt = chat_prompt(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") == tiny_tokenizer.eos_token_id


def test_batched_left_padded_generation_matches_single(tiny_model, tiny_tokenizer):
    prompts = [chat_prompt(tiny_tokenizer, [{"role": "user", "content": c}]) for c in ("a", "a much longer prompt")]
    params = GenerationParams(max_new_tokens=6)
    batched = generate(tiny_model, tiny_tokenizer, prompts, params, batch_size=2)
    single = [generate(tiny_model, tiny_tokenizer, [p], params)[0] for p in prompts]
    # greedy decoding must not depend on batch composition
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]
    assert batched[1].prompt_tokens > batched[0].prompt_tokens
    assert all(c.completion_tokens <= 6 for c in batched)


def test_stop_strings_cut_at_earliest():
    assert truncate_at_stop("abc STOP def END", ["END", "STOP"]) == ("abc ", True)
    assert truncate_at_stop("abc", ["x"]) == ("abc", False)


def test_sampling_seed_is_reproducible(tiny_model, tiny_tokenizer):
    p = [chat_prompt(tiny_tokenizer, [{"role": "user", "content": "x"}])]
    params = GenerationParams(max_new_tokens=8, temperature=1.0, seed=123)
    a = generate(tiny_model, tiny_tokenizer, p, params)[0].token_ids
    b = generate(tiny_model, tiny_tokenizer, p, params)[0].token_ids
    assert a == b
    torch.manual_seed(0)
