"""vLLM's own benchmark client (`vllm bench serve`: random dataset, completions, streamed) against
`llmkit serve` on both engines: every request succeeds, with ``ignore_eos`` on (the client's
default for the random dataset, and ``--ignore-eos``) and off (``--extra-body``). It also calls
``/tokenize`` to align its prompts with the server's tokenizer.

The runner is ``llmkit.experiments.serving.vllm_bench_client`` (bench/serving.py's side-by-side uses the same).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS, OUT = 4, 8


@pytest.fixture(scope="module")
def bench():
    from llmkit.experiments import serving

    return serving


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """`llmkit serve` (transformers engine) over the tiny model; its tokenizer saved for the client."""
    from llmkit.engines.hf import HFEngine
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app
    from llmkit.testing import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save_pretrained(folder)
    with BackgroundServer(build_app(HFEngine(tiny_llama(), tok), ServerConfig(model_name="tiny"))) as server:
        server.tokenizer_path = str(folder)
        yield server


def run(bench, url, model, tokenizer, ignore_eos: bool) -> dict:
    r = bench.vllm_bench_client(url, model, tokenizer, num_prompts=PROMPTS, input_len=24, output_len=OUT,
                                concurrency=PROMPTS, ignore_eos=ignore_eos,
                                extra_body=None if ignore_eos else {"ignore_eos": False})
    assert r["completed"] == PROMPTS and r["failed"] == 0, r.get("errors")
    if ignore_eos:  # honoured: every answer runs to its length
        assert r["total_output_tokens"] == PROMPTS * OUT
    return r


@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore_eos", "eos"])
def test_vllm_bench_client_against_the_hf_engine(bench, tiny_server, ignore_eos):
    run(bench, tiny_server.url, "tiny", tiny_server.tokenizer_path, ignore_eos)


@pytest.mark.bundled
@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore_eos", "eos"])
def test_vllm_bench_client_against_the_vllm_engine(bench, vllm_server, ignore_eos):
    from llmkit.models import resolve

    run(bench, vllm_server.url, "smollm2-135m-instruct", str(resolve(None)), ignore_eos)
