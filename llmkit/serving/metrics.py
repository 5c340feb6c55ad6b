"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
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
