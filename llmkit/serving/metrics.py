"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process).

Two families: llmkit's own ``llmkit_*`` (HTTP requests by path and status,
errors, guard verdicts, ...) and the engine statistics under vLLM's names and
labels (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_success_total{finished_reason}``, ... with ``model_name`` and
``engine`` labels), whichever engine serves, so dashboards and autoscalers
written for ``vllm serve`` read an ``llmkit serve`` unchanged.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class VLLMNames:
    """The engine statistics under vLLM's metric names and labels (``model_name``, ``engine``)."""

    def __init__(self, registry, model_name: str):
        lab = ["model_name", "engine"]
        self.labels = (model_name, "0")
        r = registry
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lab,
                             registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lab,
                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               lab + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lab, buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             lab, buckets=E2E_BUCKETS, registry=r)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", lab,
                                        buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                            "processed.", lab, buckets=TOKEN_BUCKETS, registry=r)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                    "parameter.", lab, buckets=TOKEN_BUCKETS, registry=r)
        self.n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", lab,
                           buckets=(1, 2, 5, 10, 20), registry=r)

    def finished(self, prompt_tokens: int, generation_tokens: int, reason: str, e2e_s: float) -> None:
        """One finished sequence (one choice): vLLM counts per request; here a request is a sequence."""
        self.prompt_tokens.labels(*self.labels).inc(prompt_tokens)
        self.generation_tokens.labels(*self.labels).inc(generation_tokens)
        self.request_prompt.labels(*self.labels).observe(prompt_tokens)
        self.request_generation.labels(*self.labels).observe(generation_tokens)
        self.success.labels(*self.labels, reason).inc()
        self.e2e.labels(*self.labels).observe(e2e_s)


class Metrics:
    def __init__(self, model_name: str = "llmkit"):
        r = self.registry = CollectorRegistry()
        self.vllm = VLLMNames(r, model_name)
        self.requests = Counter("llmkit_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.errors = Counter("llmkit_errors", "requests answered with an error, by error type", ["type"],
                              registry=r)
        self.prompt_tokens = Counter("llmkit_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.completion_tokens = Counter("llmkit_completion_tokens", "generated tokens", registry=r)
        self.latency = Histogram("llmkit_request_latency_seconds", "end-to-end latency of generation requests",
                                 ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("llmkit_time_to_first_token_seconds", "time until the first generated text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.active = Gauge("llmkit_active_requests", "generation requests holding a slot", registry=r)
        self.queue_depth = Gauge("llmkit_queue_depth", "sequences waiting for the engine", registry=r)
        self.running = Gauge("llmkit_running_sequences", "sequences the engine is generating now", registry=r)
        self.guard_flagged = Counter("llmkit_guard_flagged", "choices the guard flagged", ["action"], registry=r)

    def bind_engine(self, streamer) -> None:
        self.queue_depth.set_function(lambda: max(0, streamer.waiting))
        self.running.set_function(lambda: streamer.running)
        self.vllm.waiting.labels(*self.vllm.labels).set_function(lambda: max(0, streamer.waiting))
        self.vllm.running.labels(*self.vllm.labels).set_function(lambda: streamer.running)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP answer (including 4xx produced before a handler runs) by path and status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            path = path if path in KNOWN_PATHS else "other"
            self.metrics.requests.labels(path, str(status[0])).inc()
            if path.startswith("/v1/") and path != "/v1/models" and status[0] == 200:
                self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
