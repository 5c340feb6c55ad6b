"""The transformers engine's decode step: its cache (``hf_batcher.new_cache``) gives the same logits as
transformers' ``DynamicCache``, also after rows are dropped and leading columns cut, and a decode step
writes in place instead of copying the whole cache; on CPU attention reads grouped key/value heads without
repeating them, with bitwise the same logits; rows sampled at temperature alone are drawn together from the
right distribution, and top_k / min_p / top_p truncate all rows at once exactly as one row at a time."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from llmkit.engines.hf import HFEngine
from llmkit.engines.hf_batcher import GQA_SDPA, HFBatcher, _Row, _trim_left, _truncate, new_cache
from llmkit.engines.stream import StreamRequest
from llmkit.generation import GenerationParams
from llmkit.testing import tiny_llama, tiny_tokenizer


def _decode(model, cache, steps: int, drop_at: int | None = None):
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # a left-padded row
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits, ptrs = [], []
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
        tok, nxt = out.logits[:, -1].argmax(-1), pos[:, -1] + 1
        for step in range(steps):
            if step == drop_at:  # the batcher drops a finished row and cuts columns nobody attends to
                keep = torch.tensor([1, 2])
                cache.batch_select_indices(keep)
                attn, tok, nxt = attn[keep], tok[keep], nxt[keep]
                attn = _trim_left(cache, attn)
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], 1)
            out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=nxt[:, None], past_key_values=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1])
            ptrs.append(cache.layers[0].keys.data_ptr())
            tok, nxt = out.logits[:, -1].argmax(-1), nxt + 1
    return logits, ptrs


def test_growing_cache_matches_dynamic_cache_and_writes_in_place():
    model = tiny_llama()
    ref, _ = _decode(model, DynamicCache(config=model.config), 12, drop_at=5)
    got, ptrs = _decode(model, new_cache(model), 12, drop_at=5)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b)
    # after the drop, the steps write into the same buffer (DynamicCache makes a new tensor every step)
    assert len(set(ptrs[6:])) == 1
    _, dyn_ptrs = _decode(model, DynamicCache(config=model.config), 4)
    assert len(set(dyn_ptrs)) > 1


def test_engine_attention_reads_grouped_heads_in_place_with_identical_logits(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    model = tiny_llama()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config._attn_implementation == "sdpa"
    HFEngine(model, tiny_tokenizer())
    assert model.config._attn_implementation == GQA_SDPA
    repeats = []
    real_repeat = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: repeats.append(n) or real_repeat(x, n))
    got, _ = _decode(model, new_cache(model), 6, drop_at=3)
    assert not repeats
    model.config._attn_implementation = "sdpa"
    ref, _ = _decode(model, new_cache(model), 6, drop_at=3)
    assert repeats  # transformers' own path copies the heads (with a mask, as here)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_rows_sampled_together_follow_their_temperature():
    batcher = HFBatcher(HFEngine(tiny_llama(), tiny_tokenizer()))

    def row(temperature):
        return _Row(StreamRequest([1], GenerationParams(temperature=temperature), lambda ev: None), None, None)

    rows = [row(1.0), row(0.0), row(0.5)]
    logits = torch.tensor([0.0, 1.0, 2.0, -30.0]).repeat(3, 1)
    torch.manual_seed(0)
    draws = torch.stack([batcher._sample(logits, rows) for _ in range(4000)])
    assert (draws[:, 1] == 2).all()  # greedy
    for i, t in ((0, 1.0), (2, 0.5)):
        freq = torch.bincount(draws[:, i], minlength=4).float() / len(draws)
        torch.testing.assert_close(freq, (logits[i] / t).softmax(-1), atol=0.03, rtol=0)


def _truncate_one(scores, temperature, top_k, min_p, top_p):
    """The per-row rule (sorting the whole vocabulary for top_p)."""
    scores = scores / temperature
    if 0 < top_k < scores.shape[0]:
        scores = scores.masked_fill(scores < scores.topk(top_k).values[-1], float("-inf"))
    if min_p > 0.0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        probs = sorted_scores.softmax(-1)
        sorted_scores[(probs.cumsum(-1) - probs) > top_p] = float("-inf")
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return scores


def test_batched_truncation_matches_the_per_row_rule():
    torch.manual_seed(0)
    vocab = 5000
    logits = torch.randn(8, vocab) * 3
    logits[5] = torch.randn(vocab) * 0.01  # nearly flat: even the best 4096 tokens hold too little, full sort
    logits[7] = torch.randn(vocab)  # flat-ish: the nucleus lies between the best 256 and the best 4096
    rows = [(1.0, 0, 0.0, 1.0), (0.7, 50, 0.0, 1.0), (1.3, 0, 0.1, 1.0), (0.8, 0, 0.0, 0.9),
            (1.0, 40, 0.05, 0.5), (1.0, 0, 0.0, 0.99), (0.5, vocab, 0.0, 0.95), (1.0, 0, 0.0, 0.9)]
    got = _truncate(logits.clone(), *map(list, zip(*rows)))
    for i, params in enumerate(rows):
        want = _truncate_one(logits[i], *params)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), params
        kept = ~torch.isinf(want)
        torch.testing.assert_close(got[i][kept], want[kept])
        assert 0 < kept.sum() < vocab or params[1:] == (0, 0.0, 1.0)
    assert (~torch.isinf(got[5])).sum() > 4096
    assert 256 < (~torch.isinf(got[7])).sum() < 4096
