"""`llmkit serve` as a command: flag checks, the --kv-cache hook, graceful shutdown of a real subprocess."""

from __future__ import annotations

import json
import signal
import sys
import types

import httpx
import pytest

from llmkit.cli import UserError, build_parser, main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from llmkit.testing import tiny_llama, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_kv_cache_with_vllm_is_refused(capsys):
    assert main(["serve", "--engine", "vllm", "--kv-cache", "inquant"]) == 2
    err = capsys.readouterr().err
    assert "--kv-cache" in err and "--engine hf" in err


def test_kv_cache_flag_builds_the_engine_with_the_named_factory(tiny_dir, monkeypatch):
    from llmkit.commands.serve import build_engine

    asked = []

    def factory_for(name):
        asked.append(name)
        if name != "inquant":
            raise ValueError(f"unknown KV cache '{name}'")
        return lambda model: None

    fake = types.ModuleType("llmkit.serving.kv_cache")
    fake.cache_factory = factory_for
    fake.inquant_serving_factory = lambda model, calibration=None: (lambda m: None, "fake InQuant message")
    monkeypatch.setitem(sys.modules, "llmkit.serving.kv_cache", fake)
    args = build_parser().parse_args(["serve", "--model", str(tiny_dir), "--kv-cache", "inquant"])
    engine = build_engine(args)
    assert asked == ["inquant"] and callable(engine.cache_factory)
    args = build_parser().parse_args(["serve", "--model", str(tiny_dir), "--kv-cache", "nope"])
    with pytest.raises(UserError, match="nope"):
        build_engine(args)
    plain = build_engine(build_parser().parse_args(["serve", "--model", str(tiny_dir)]))
    assert plain.cache_factory is None


@pytest.mark.slow  # a real `llmkit serve` process: imports torch + transformers + fastapi afresh
def test_sigterm_lets_the_running_stream_finish(tiny_dir):
    from llmkit.experiments.harness import ServeProcess

    # ServeProcess: a port its own server listens on (a port chosen by closing a socket can be taken meanwhile)
    with ServeProcess(["--model", str(tiny_dir), "--threads", "1", "--max-model-len", "512"], timeout=120) as srv:
        proc, url = srv.proc, srv.url
        body = {"prompt": "graceful", "max_tokens": 60, "stream": True, "temperature": 0}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(60) == 0
