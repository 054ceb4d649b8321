"""Prometheus metrics of one server: the engine loop's state at scrape time, and per-request latencies.

Names follow vLLM's (``vllm:`` becomes ``jaxrunner:``), so dashboards built for one read the other.
Each server has its own registry, so several servers in one process (tests) do not collide.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxrunner.engine.loop import EngineLoop

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._loop: EngineLoop | None = None
        gauge = lambda name, doc: Gauge(f"jaxrunner:{name}", doc, registry=self.registry)  # noqa: E731
        gauge("num_requests_running", "Requests in the engine's running set.").set_function(
            lambda: self._stat("running"))
        gauge("num_requests_waiting", "Requests waiting to be scheduled.").set_function(
            lambda: self._stat("waiting"))
        gauge("kv_cache_pages_used", "KV cache pages held by requests.").set_function(
            lambda: self._stat("pages_in_use"))
        gauge("kv_cache_pages_free", "KV cache pages free (cached prefixes count as free).").set_function(
            lambda: self._stat("pages_total") - self._stat("pages_in_use"))
        gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.").set_function(
            self._hit_rate)
        self.ttft = Histogram("jaxrunner:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("jaxrunner:inter_token_latency_seconds", "Time between consecutive outputs.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("jaxrunner:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("jaxrunner:generation_tokens", "Generated tokens of finished requests.",
                                         registry=self.registry)
        self.requests = Counter("jaxrunner:request_success", "Requests finished.", ["finished_reason"],
                                registry=self.registry)

    def attach(self, loop: EngineLoop) -> None:
        self._loop = loop

    def _stat(self, name: str) -> float:
        return 0.0 if self._loop is None else float(getattr(self._loop.stats, name))

    def _hit_rate(self) -> float:
        prompt = self._stat("prompt_tokens")
        return self._stat("prefix_cache_hit_tokens") / prompt if prompt else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Records TTFT and inter-token latency of one request as its outputs arrive, and how it ended."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.start = time.perf_counter()
        self.last: float | None = None
        self.generated = 0
        self.done = False

    def output(self, generated_tokens: int) -> None:
        self.generated = generated_tokens
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def finished(self, generated_tokens: int, reason: str | None) -> None:
        if self.done:
            return
        self.done = True
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        self.metrics.generation_tokens.inc(generated_tokens)
        self.metrics.requests.labels(finished_reason=reason or "abort").inc()

    def aborted(self) -> None:
        """Stopped before its last output (the client left, or the server is shutting down)."""
        self.finished(self.generated, "abort")
