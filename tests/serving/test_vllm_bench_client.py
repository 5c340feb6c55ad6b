"""vLLM's own benchmark client (`vllm bench serve`: random dataset, completions, streamed) against
`llmkit serve` on both engines: every request succeeds, with ``ignore_eos`` on (the client's
default for the random dataset, and ``--ignore-eos``) and off (``--extra-body``). It also calls
``/tokenize`` to align its prompts with the server's tokenizer.

The runner is ``llmkit.experiments.serving.vllm_bench_client`` (bench/serving.py's side-by-side uses the same).
It starts the client in a new interpreter; importing vLLM's benchmark module there is most of a run's time, so
one run here does that and the others hand the same command line to the client's ``main`` in this process.
"""

from __future__ import annotations

import subprocess

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS, OUT = 4, 8


@pytest.fixture(scope="module")
def bench():
    from llmkit.experiments import serving

    return serving


@pytest.fixture()
def in_process(bench, monkeypatch):
    """``vllm_bench_client``'s command line (``VLLM_BENCH`` + its flags) run by the client's ``main`` here; any
    other ``subprocess.run`` (the module is shared) runs as usual."""
    real = subprocess.run

    def run(cmd, *args, **kw):
        if list(cmd[:len(bench.VLLM_BENCH)]) != bench.VLLM_BENCH:
            return real(cmd, *args, **kw)
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        p = FlexibleArgumentParser()
        add_cli_args(p)
        main(p.parse_args(cmd[len(bench.VLLM_BENCH):]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)


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


# in-process on the hf engine: this worker has not imported vLLM, and imports its client once for both cases
@pytest.mark.parametrize("ignore_eos", [True, False], ids=["ignore_eos", "eos"])
def test_vllm_bench_client_against_the_hf_engine(bench, tiny_server, in_process, ignore_eos):
    run(bench, tiny_server.url, "tiny", tiny_server.tokenizer_path, ignore_eos)


@pytest.mark.bundled
def test_vllm_bench_client_in_a_new_interpreter_against_the_vllm_engine(bench, vllm_server):
    from llmkit.models import resolve

    run(bench, vllm_server.url, "smollm2-135m-instruct", str(resolve(None)), True)


@pytest.mark.bundled
def test_vllm_bench_client_against_the_vllm_engine_without_ignore_eos(bench, vllm_server, in_process):
    from llmkit.models import resolve

    run(bench, vllm_server.url, "smollm2-135m-instruct", str(resolve(None)), False)
