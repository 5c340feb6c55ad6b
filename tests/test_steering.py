"""Steering vectors: extraction is a difference of means, hooks act per row and vanish on removal."""

from __future__ import annotations

import pytest
import torch

from llmkit.steering import Steering, SteeringVector, capture, decoder_layers, extract, steer


@pytest.fixture()
def vec(tiny_model):
    torch.manual_seed(1)
    return SteeringVector({1: torch.randn(tiny_model.config.hidden_size) * 4.0}, behavior="test")


def _batch(tok, texts):
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def _greedy(model, enc, n=12):
    with torch.no_grad():
        return model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)


def test_hook_changes_generation_only_while_attached(tiny_model, tiny_tokenizer, vec):
    enc = _batch(tiny_tokenizer, ["What is 2 + 2?", "Name a colour."])
    before = _greedy(tiny_model, enc)
    with steer(tiny_model, vec, 0.0):
        zero = _greedy(tiny_model, enc)
    with steer(tiny_model, vec, 3.0) as st:
        assert st.active
        steered = _greedy(tiny_model, enc)
    after = _greedy(tiny_model, enc)
    assert torch.equal(zero, before)
    assert torch.equal(after, before)
    assert not torch.equal(steered, before)
    assert all(not layer._forward_hooks for layer in decoder_layers(tiny_model))


def test_per_row_alpha_adds_exactly_alpha_times_vector_to_each_row(tiny_model, tiny_tokenizer, vec):
    enc = _batch(tiny_tokenizer, ["same prompt"] * 4)
    alphas = torch.tensor([0.0, 2.0, 0.0, -1.5])
    with torch.no_grad(), capture(tiny_model, [1]) as plain:
        tiny_model(**enc)
    base = plain[1].clone()
    # capture is entered after Steering, so its hook runs after the steering hook: it sees the steered output
    with torch.no_grad(), Steering(tiny_model, vec, alphas), capture(tiny_model, [1]) as seen:
        tiny_model(**enc)
    delta = seen[1] - base
    for b, a in enumerate(alphas.tolist()):
        expected = (a * vec.directions[1]).expand_as(delta[b])
        torch.testing.assert_close(delta[b], expected, atol=1e-5, rtol=1e-5)


def test_per_row_alpha_steers_generation_of_the_right_rows(tiny_model, tiny_tokenizer, vec):
    enc = _batch(tiny_tokenizer, ["hello"] * 3)
    plain = _greedy(tiny_model, enc)
    with steer(tiny_model, vec, 3.0):
        full = _greedy(tiny_model, enc)
    with steer(tiny_model, vec, [0.0, 3.0, 0.0]):
        mixed = _greedy(tiny_model, enc)
    assert torch.equal(mixed[0], plain[0]) and torch.equal(mixed[2], plain[2])
    assert torch.equal(mixed[1], full[1]) and not torch.equal(mixed[1], plain[1])


def test_wrong_number_of_alphas_is_an_error(tiny_model, tiny_tokenizer, vec):
    enc = _batch(tiny_tokenizer, ["a", "b"])
    with steer(tiny_model, vec, [1.0, 2.0, 3.0]), pytest.raises(ValueError, match="3 intensities"):
        tiny_model(**enc)
    assert all(not layer._forward_hooks for layer in decoder_layers(tiny_model))


def test_extract_is_difference_of_mean_last_token_states(tiny_model, tiny_tokenizer):
    pos, neg = ["be long please", "write a lot"], ["be short", "one word"]
    v = extract(tiny_model, tiny_tokenizer, list(zip(pos, neg)), layers=[0, 1], chat=False)

    def mean_last(texts, layer):
        rows = []
        for t in texts:  # one at a time: no padding involved in the reference
            ids = tiny_tokenizer(t, return_tensors="pt", add_special_tokens=False)
            with torch.no_grad():
                hs = tiny_model(**ids, output_hidden_states=True).hidden_states
            rows.append(hs[layer + 1][0, -1])
        return torch.stack(rows).mean(0)

    # hidden_states[l + 1] is decoder layer l's output for every layer but the last (which gets the final norm)
    torch.testing.assert_close(v.directions[0], mean_last(pos, 0) - mean_last(neg, 0), atol=1e-4, rtol=1e-4)
    assert v.layers == [0, 1] and v.meta["num_pairs"] == 2


def test_save_load_roundtrip_and_compatibility(tmp_path, tiny_model, vec):
    from llmkit.steering import check_compatible
    from llmkit.testing import tiny_llama

    vec.save(tmp_path / "v")
    back = SteeringVector.load(tmp_path / "v")
    assert back.behavior == "test" and back.layers == [1]
    assert torch.equal(back.directions[1], vec.directions[1].float())
    check_compatible(tiny_model, back)
    with pytest.raises(ValueError, match="hidden size"):
        check_compatible(tiny_llama(hidden_size=32), back)
    with pytest.raises(FileNotFoundError):
        SteeringVector.load(tmp_path / "nothing")


def test_bad_layer_is_rejected(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        extract(tiny_model, tiny_tokenizer, [("a", "b")], layers=[5])


def test_steer_extract_cli_writes_a_loadable_vector_and_reports_bad_lines(tmp_path, capsys):
    import json

    from llmkit.cli import main
    from llmkit.testing import tiny_llama, tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"positive": "long answer", "negative": "short"}) + "\n"
                     + json.dumps({"positive": [{"role": "user", "content": "x, in detail"}],
                                   "negative": [{"role": "user", "content": "x"}]}) + "\n")
    out = tmp_path / "vec"
    assert main(["steer", "extract", "--model", str(folder), "--pairs", str(pairs), "--layers", "0,1",
                 "--output", str(out)]) == 0
    assert SteeringVector.load(out).layers == [0, 1]
    assert "2 pairs" in capsys.readouterr().out
    pairs.write_text(json.dumps({"positive": "a", "negative": "b"}) + "\n{not json\n")
    assert main(["steer", "extract", "--model", str(folder), "--pairs", str(pairs), "--output", str(out)]) == 2
    assert f"{pairs}:2" in capsys.readouterr().err
    assert main(["steer", "extract", "--model", str(folder), "--pairs", str(tmp_path / "pairs.jsonl"),
                 "--layers", "7", "--output", str(out)]) == 2


def test_answer_positions_shift_only_the_last_prompt_position_and_decoded_tokens(tiny_model, tiny_tokenizer, vec):
    enc = _batch(tiny_tokenizer, ["same prompt here", "another one"])
    with torch.no_grad(), capture(tiny_model, [1]) as plain:
        tiny_model(**enc)
    base = plain[1].clone()
    with torch.no_grad(), Steering(tiny_model, vec, 2.0, positions="answer"), capture(tiny_model, [1]) as seen:
        tiny_model(**enc)
    delta = seen[1] - base
    torch.testing.assert_close(delta[:, :-1], torch.zeros_like(delta[:, :-1]))  # the prompt is read unsteered
    torch.testing.assert_close(delta[:, -1], (2.0 * vec.directions[1]).expand_as(delta[:, -1]), atol=1e-5, rtol=1e-5)
    # decoding: a one-position forward (a new token, read with the cache) is steered in full
    one = {"input_ids": enc["input_ids"][:, -1:], "attention_mask": enc["attention_mask"][:, -1:]}
    with torch.no_grad(), capture(tiny_model, [1]) as plain_one:
        tiny_model(**one)
    with torch.no_grad(), Steering(tiny_model, vec, 2.0, positions="answer"), capture(tiny_model, [1]) as seen_one:
        tiny_model(**one)
    torch.testing.assert_close(seen_one[1] - plain_one[1], (2.0 * vec.directions[1]).expand_as(plain_one[1]),
                               atol=1e-5, rtol=1e-5)
    plain_gen = _greedy(tiny_model, enc)
    with steer(tiny_model, vec, 3.0, positions="answer"):
        assert not torch.equal(_greedy(tiny_model, enc), plain_gen)


def test_unknown_positions_is_an_error(tiny_model, vec):
    with pytest.raises(ValueError, match="positions must be one of all, answer"):
        Steering(tiny_model, vec, 1.0, positions="prompt")
