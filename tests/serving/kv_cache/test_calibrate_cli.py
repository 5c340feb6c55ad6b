"""`llmkit kv calibrate` and how `llmkit serve --kv-cache inquant` picks the calibration up."""

from __future__ import annotations

import json

import pytest

from llmkit.cli import UserError, build_parser, main
from llmkit.serving.kv_cache import (
    InQuantCache,
    InQuantCalibration,
    default_calibration_path,
    read_calibration_texts,
)
from llmkit.testing import tiny_llama, tiny_tokenizer


@pytest.fixture()
def tiny_dir(tmp_path):
    d = tmp_path / "tiny-model"
    tiny_llama().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture()
def data(tmp_path):
    p = tmp_path / "calib.jsonl"
    rows = [{"question": f"What is {i} plus {i + 1}? Explain.", "answer": f"{i} + {i + 1} = {2 * i + 1}. #### {2 * i + 1}"}
            for i in range(40)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def _serve_cache(tiny_dir, capsys, *extra):
    from llmkit.commands.serve import build_engine

    engine = build_engine(build_parser().parse_args(["serve", "--model", str(tiny_dir), "--kv-cache", "inquant",
                                                     *extra]))
    return engine.cache_factory(engine.model), capsys.readouterr().err


def test_serve_says_it_is_uncalibrated_then_uses_the_saved_calibration(tiny_dir, data, capsys):
    cache, err = _serve_cache(tiny_dir, capsys)
    assert isinstance(cache, InQuantCache)
    assert cache.layout == "per-channel" and cache.calibration is None and not cache.rows_mergeable
    assert "no calibration" in err and "llmkit kv calibrate" in err and "static batching" in err

    assert main(["kv", "calibrate", "--model", str(tiny_dir), "--data", str(data), "--start", "0",
                 "--texts", "3", "--max-len", "64"]) == 0
    out = capsys.readouterr().out
    path = tiny_dir / "kv_cache" / "inquant_calibration.safetensors"
    assert path.is_file() and str(path) in out and "pairs kept" in out
    cal = InQuantCalibration.load(path)
    assert cal.meta["texts"] == 3 and cal.meta["cache"] == {"layout": "per-token", "gate": "score",
                                                            "n_outliers": 4, "group_size": 128}

    cache, err = _serve_cache(tiny_dir, capsys)
    assert cache.layout == "per-token" and cache.gate == "score" and cache.calibration is not None
    assert cache.rows_mergeable  # requests join running batches
    assert "calibrated from" in err and "continuous batching" in err


def test_saved_cache_settings_are_what_serve_builds(tiny_dir, data, tmp_path, capsys):
    out = tmp_path / "elsewhere.safetensors"
    assert main(["kv", "calibrate", "--model", str(tiny_dir), "--data", str(data), "--start", "0", "--texts", "2",
                 "--max-len", "48", "--layout", "per-channel", "--gate", "off", "--n-outliers", "2",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    assert not (tiny_dir / "kv_cache").exists()  # --out, not the default place
    cache, err = _serve_cache(tiny_dir, capsys, "--kv-calibration", str(out))
    assert (cache.layout, cache.gate, cache.n_outliers) == ("per-channel", "off", 2)
    assert "static batching" in err  # per-channel groups cannot be cut at any column


def test_user_mistakes_are_one_line_errors(tiny_dir, data, tmp_path, capsys):
    assert main(["kv", "calibrate", "--model", str(tiny_dir), "--data", str(tmp_path / "nope.jsonl")]) == 2
    assert "--data" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine line"}\n{"title": "no text here"}\n')
    assert main(["kv", "calibrate", "--model", str(tiny_dir), "--data", str(bad), "--start", "0"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "'text'" in err
    assert main(["serve", "--model", str(tiny_dir), "--kv-cache", "inquant", "--kv-calibration",
                 str(tmp_path / "missing.safetensors")]) == 2
    assert "missing.safetensors" in capsys.readouterr().err
    with pytest.raises(UserError, match="only with --kv-cache inquant"):
        _serve_cache_kivi(tiny_dir, data)


def _serve_cache_kivi(tiny_dir, data):
    from llmkit.commands.serve import build_engine

    build_engine(build_parser().parse_args(["serve", "--model", str(tiny_dir), "--kv-cache", "kivi",
                                            "--kv-calibration", str(data)]))


def test_a_calibration_for_another_model_is_refused(tiny_dir, data, tmp_path, capsys):
    other = tmp_path / "deeper"
    tiny_llama(num_layers=3).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert main(["kv", "calibrate", "--model", str(other), "--data", str(data), "--start", "0", "--texts", "1",
                 "--max-len", "32"]) == 0
    capsys.readouterr()
    with pytest.raises(UserError, match="3 layers, the model 2"):
        _serve_cache(tiny_dir, capsys, "--kv-calibration", str(other / "kv_cache" / "inquant_calibration.safetensors"))


def test_help_names_the_serving_hookup(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["kv", "calibrate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "serve --kv-cache inquant" in text and "--data" in text and "--layout" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-calibration" in text and "llmkit kv calibrate" in text


def test_calibration_texts_pack_records_up_to_the_length(data, tmp_path):
    tok = tiny_tokenizer()  # byte-level: one token per byte
    texts = read_calibration_texts(data, tok, n_texts=3, max_len=120, start=2)
    assert len(texts) == 3
    assert texts[0].startswith("Question: What is 2 plus 3?")  # lines 1-2 skipped
    for t in texts:
        n = len(tok(t, add_special_tokens=False).input_ids)
        assert n >= 120 and n < 120 + 80  # whole records, stopped once the length is reached
    plain = tmp_path / "notes.txt"
    plain.write_text("abcdefghij" * 25)
    pieces = read_calibration_texts(plain, tok, n_texts=10, max_len=100)
    assert [len(p) for p in pieces] == [100, 100, 50]
    with pytest.raises(ValueError, match="no calibration text"):
        empty = tmp_path / "empty.txt"
        empty.write_text("   \n")
        read_calibration_texts(empty, tok)


def test_lm_eval_model_uses_the_calibration_serve_would(tiny_dir, data, capsys):
    """`kv_cache=inquant` through lm-eval builds the same cache as `llmkit serve --kv-cache inquant`."""
    from llmkit.evals.lmeval import LlmkitLM

    lm = LlmkitLM(pretrained=str(tiny_dir), engine="hf", kv_cache="inquant", device="cpu")
    assert not lm.engine.cache_factory(lm.engine.model).rows_mergeable
    assert "no calibration" in capsys.readouterr().err
    assert main(["kv", "calibrate", "--model", str(tiny_dir), "--data", str(data), "--start", "0",
                 "--texts", "3", "--max-len", "64"]) == 0
    capsys.readouterr()
    lm = LlmkitLM(pretrained=str(tiny_dir), engine="hf", kv_cache="inquant", device="cpu")
    cache = lm.engine.cache_factory(lm.engine.model)
    assert cache.layout == "per-token" and cache.calibration is not None and cache.rows_mergeable
    assert "calibrated from" in capsys.readouterr().err


def test_calibration_file_lives_in_a_subfolder_of_a_local_model(tmp_path, tiny_model, monkeypatch):
    tiny_model.config._name_or_path = str(tmp_path)
    assert default_calibration_path(tiny_model) == tmp_path / "kv_cache" / "inquant_calibration.safetensors"
    monkeypatch.setenv("LLMKIT_HOME", str(tmp_path / "home"))
    tiny_model.config._name_or_path = "org/some-model"
    assert default_calibration_path(tiny_model) == tmp_path / "home" / "kv_calibration" / "org--some-model.safetensors"
