"""Model loading: hub-style folders, the bundled alias (converted once, atomically), clear errors."""

from __future__ import annotations

import time

import pytest

from llmkit import models
from llmkit.models import ModelNotFoundError


def test_local_folder_round_trip(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    model, tok = models.load(str(tmp_path / "m"))
    assert model.config.num_hidden_layers == 2
    assert tok.chat_template == tiny_tokenizer.chat_template


def test_missing_path_and_unknown_alias_list_aliases(tmp_path):
    for bad in (str(tmp_path / "missing"), "not-an-alias"):
        with pytest.raises(ModelNotFoundError) as e:
            models.resolve(bad)
        assert "smollm2-135m-instruct" in str(e.value) and bad in str(e.value)


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        models.resolve(str(tmp_path / "empty"))


def test_bad_dtype_named():
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        models.parse_dtype("float7")


def _stand_in_gguf(tmp_path, monkeypatch) -> list:
    """The alias under a temporary LLMKIT_HOME, its "GGUF" a tiny model: what ``_convert`` does around the
    conversion (temporary sibling, rename, lock) costs no 135M dequantization. Returns the conversions made."""
    from llmkit.testing import tiny_llama, tiny_tokenizer

    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "_package_folder", lambda package: tmp_path)
    (tmp_path / models.ALIASES[models.DEFAULT_MODEL].gguf_file).write_text("")
    calls = []

    def from_gguf(gguf_dir, gguf_file):
        calls.append(gguf_file)
        return tiny_llama(), tiny_tokenizer()

    monkeypatch.setattr(models, "_from_gguf", from_gguf)
    return calls


def _no_second_conversion(*a, **kw):
    raise AssertionError("a second resolve of the alias should read the cached safetensors")


def test_alias_conversion_is_atomic_and_cached(tmp_path, monkeypatch):
    calls = _stand_in_gguf(tmp_path, monkeypatch)
    from transformers import PreTrainedModel

    real_save = PreTrainedModel.save_pretrained

    def crash_midway(self, folder, *a, **kw):
        real_save(self, folder, *a, **kw)  # files are written, then the process "dies"
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        models.materialize_alias(models.DEFAULT_MODEL)
    target = models.alias_dir(models.DEFAULT_MODEL)
    assert calls, "the interruption came before the conversion ran"
    assert not target.exists(), "an interrupted conversion left a folder at the final path"
    assert list(target.parent.glob(".*partial*")) == []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)

    # a stale, broken folder at the final path (e.g. from an older tool) is also recovered
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    model, _ = models.load(models.DEFAULT_MODEL)
    assert model.config.model_type == "llama" and len(calls) == 2
    assert any(target.glob("*.safetensors")) and list(target.parent.glob(".*partial*")) == []

    monkeypatch.setattr(models, "_convert", _no_second_conversion)
    assert models.resolve(models.DEFAULT_MODEL) == str(target)


@pytest.mark.bundled
def test_bundled_gguf_converts_to_a_trainable_cached_checkpoint(tmp_path, monkeypatch, session_started):
    """The real conversion of the 135M GGUF, once per run (the stand-in test above covers interruption and
    recovery)."""
    import torch

    # where the user's cache lacks the alias (a fresh machine) this conversion is the one the rest of the
    # session reuses; where another test of this run (the other xdist worker) converted it already, that
    # conversion is checked; where an earlier run left it, one under tmp_path, so every run converts once
    cached = models.alias_dir(models.DEFAULT_MODEL)
    if models._is_complete(cached) and cached.stat().st_mtime < session_started:
        monkeypatch.setenv("LLMKIT_HOME", str(tmp_path))
    model, tok = models.load(models.DEFAULT_MODEL)
    target = models.alias_dir(models.DEFAULT_MODEL)
    assert model.config.model_type == "llama" and model.num_parameters() > 100e6
    assert any(target.glob("*.safetensors")) and "quantization_config" not in model.config.to_dict()

    monkeypatch.setattr(models, "_convert", _no_second_conversion)
    assert models.resolve(models.DEFAULT_MODEL) == str(target)
    # trainable: a gradient step works on the converted weights, read back from the saved safetensors
    ids = tok("12 + 30 =", return_tensors="pt").input_ids
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.embed_tokens.weight.grad is not None


@pytest.mark.bundled
def test_bundled_model_answers_sensibly(bundled):
    from llmkit.generation import GenerationParams, chat_prompt, generate

    model, tok = bundled
    out = generate(model, tok, [chat_prompt(tok, [{"role": "user", "content": "What is the capital of France?"}])],
                   GenerationParams(max_new_tokens=20))[0]
    assert "Paris" in out.text


def test_concurrent_conversions_convert_once(tmp_path, monkeypatch):
    """Two processes (accelerate ranks, test workers) asking at once: one converts, the other waits and reuses it."""
    import threading

    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path))
    monkeypatch.setattr(models, "_package_folder", lambda package: tmp_path)
    (tmp_path / models.ALIASES[models.DEFAULT_MODEL].gguf_file).write_text("")
    calls = []

    def slow_convert(spec, gguf_dir, target, alias, verbose):
        calls.append(alias)
        time.sleep(0.5)
        target.mkdir(parents=True)
        for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
            (target / name).write_text("{}")
        return target

    monkeypatch.setattr(models, "_convert", slow_convert)
    out = []
    threads = [threading.Thread(target=lambda: out.append(models.materialize_alias(models.DEFAULT_MODEL)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [models.DEFAULT_MODEL] and len(set(out)) == 1 and len(out) == 3


def test_gguf_is_parsed_once_inside_the_conversion_and_gguf_is_restored_after(monkeypatch, tmp_path):
    """transformers opens the GGUF three times (config, weights, tokenizer) and builds a tensor-name map per
    module; inside ``_gguf_parsed_once`` each file is parsed once and each map built once, and outside it
    gguf's own functions are back."""
    import gguf

    from llmkit.models import _gguf_parsed_once

    parsed, built = [], []

    class CountingReader:
        def __init__(self, path, mode="r"):
            parsed.append((str(path), mode))

    def name_map(arch, n_blocks):
        built.append((arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    with _gguf_parsed_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first and gguf.GGUFReader(b) is not first
        assert gguf.get_tensor_name_map("llama", 30) is gguf.get_tensor_name_map("llama", 30)
        gguf.get_tensor_name_map("llama", 2)
    assert parsed == [(str(a), "r"), (str(b), "r")]
    assert built == [("llama", 30), ("llama", 2)]
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is name_map
