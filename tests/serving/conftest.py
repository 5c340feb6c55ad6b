"""One vLLM engine (bundled model, eager) behind `llmkit serve` for the serving tests that need it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_server():
    """``llmkit serve --engine vllm`` in-process on loopback: ``.url``, ``.http`` (httpx), ``.engine``."""
    import httpx

    from llmkit.engines.vllm import VLLMEngine
    from llmkit.serving.server import BackgroundServer, ServerConfig, build_app

    engine = VLLMEngine(None, enforce_eager=True)
    try:
        with BackgroundServer(build_app(engine, ServerConfig(model_name="smollm2-135m-instruct"))) as server, \
                httpx.Client(base_url=server.url, timeout=300) as http:
            server.engine, server.http = engine, http
            yield server
    finally:
        engine.close()
